"""The one TOML config shared by all three processes.

Precedence: defaults < TOML file < `RUSTINFER_<FIELD>` environment variables < explicit CLI overrides.
Unknown or invalid fields are refused with a message naming the field.
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

ENV_PREFIX = "RUSTINFER_"


class ConfigError(ValueError):
    """A config file, environment variable or override is unknown or invalid (the message names the field)."""


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # model
    model: str = ""  # HF model directory; "" = the embedded SmolLM2-135M-Instruct
    model_name: str = ""  # name served at /v1/models; "" = the model directory's name
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    # backend
    backend: str = "auto"  # auto | cpu | cuda | any name in the `rustinfer.backends` entry point group
    device: str = ""  # "" = the backend's default (cpu, cuda:0)
    tensor_parallel_size: int = 1
    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    max_inflight_requests: int = 1024
    max_request_body_bytes: int = 4 * 1024 * 1024
    enable_console: bool = True  # serve the browser console at / when infer-frontend is installed
    server_processes: int = 1  # HTTP processes sharing the port (SO_REUSEPORT): streaming is Python work per token
    # scheduling
    max_batch_tokens: int = 8192
    max_batch_seqs: int = 256
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    chunked_prefill_size: int = 2048
    enable_prefix_caching: bool = True
    enable_overlap: bool = True  # plan step k+1 before step k's tokens are back (DESIGN §5); false = synchronous
    ignore_eos: bool = False
    # KV cache
    mem_fraction_static: float = 0.85
    num_blocks: int = 0  # 0 = sized from a memory profile
    block_size: int = 16
    cpu_kv_cache_bytes: int = 1 << 30  # budget for num_blocks = 0 on the CPU backend
    # CUDA graphs
    # a batch runs the graph of the next size up: steps between sizes bound the padding (<= 25% from 32 up)
    capture_sizes: list[int] = msgspec.field(
        default_factory=lambda: [1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 224, 256])
    # mixed steps (prefill chunks, with or without decodes) of up to this many tokens replay CUDA graphs too
    capture_tokens: list[int] = msgspec.field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048])
    enable_cuda_graphs: bool = True
    # processes
    cluster_id: str = "default"
    ipc_dir: str = ""  # "" = the system temp dir
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # supervision by `rustinfer serve`: a worker that dies is restarted, a bounded number of times
    worker_max_restarts: int = 3  # restarts allowed within worker_restart_window_secs; one more death stops serve
    worker_restart_window_secs: float = 60.0  # a restart older than this no longer counts against the limit
    worker_restart_backoff_secs: float = 1.0  # delay before the first restart in the window; doubles with each next
    # timeouts (seconds)
    request_timeout_secs: float = 600.0
    ready_timeout_secs: float = 600.0
    heartbeat_interval_secs: float = 0.5
    worker_timeout_secs: float = 30.0  # no heartbeat for this long = the worker is lost
    scheduler_timeout_secs: float = 5.0  # no pong for this long = the scheduler is lost
    shutdown_timeout_secs: float = 10.0

    def __post_init__(self) -> None:
        _validate(self)

    def ipc_path(self, channel: str) -> str:
        """The ZMQ IPC address of one channel (`sched`, `plan`, `result`), unique per cluster_id."""
        base = Path(self.ipc_dir or tempfile.gettempdir())
        return f"ipc://{base / f'rustinfer-{self.cluster_id}-{channel}.ipc'}"


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"config field '{name}' must be > 0, got {value!r}")


def _validate(c: Config) -> None:
    for name in ("max_batch_tokens", "max_batch_seqs", "chunked_prefill_size", "block_size", "tensor_parallel_size",
                 "max_inflight_requests", "max_request_body_bytes", "request_timeout_secs", "ready_timeout_secs",
                 "heartbeat_interval_secs", "worker_timeout_secs", "scheduler_timeout_secs", "cpu_kv_cache_bytes",
                 "worker_restart_window_secs"):
        _positive(name, getattr(c, name))
    for name in ("max_model_len", "num_blocks", "seed", "worker_max_restarts", "worker_restart_backoff_secs"):
        if getattr(c, name) < 0:
            raise ConfigError(f"config field '{name}' must be >= 0, got {getattr(c, name)!r}")
    if not 0.0 < c.mem_fraction_static <= 1.0:
        raise ConfigError(f"config field 'mem_fraction_static' must be in (0, 1], got {c.mem_fraction_static!r}")
    if not 0 < c.port < 65536:
        raise ConfigError(f"config field 'port' must be in 1..65535, got {c.port!r}")
    if any(s <= 0 for s in c.capture_sizes):
        raise ConfigError(f"config field 'capture_sizes' must hold positive sizes, got {c.capture_sizes!r}")
    if c.server_processes < 1:
        raise ConfigError(f"config field 'server_processes' must be >= 1, got {c.server_processes}")
    if any(s <= 0 for s in c.capture_tokens):
        raise ConfigError(f"config field 'capture_tokens' must hold positive sizes, got {c.capture_tokens!r}")
    if not c.cluster_id or not all(ch.isalnum() or ch in "-_" for ch in c.cluster_id):
        raise ConfigError(f"config field 'cluster_id' must be non-empty [A-Za-z0-9_-], got {c.cluster_id!r}")
    if c.tensor_parallel_size != 1:
        raise ConfigError("config field 'tensor_parallel_size' > 1 is not supported yet")


FIELDS: tuple[str, ...] = Config.__struct_fields__


def _parse_env_value(name: str, raw: str) -> Any:
    """Environment values are TOML literals (`8`, `true`, `[1, 2]`); anything else is taken as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _convert(data: dict[str, Any]) -> Config:
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Build the config from the TOML file (optional), the environment and explicit overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data.update(tomllib.load(fh))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    env = os.environ if environ is None else environ
    for key, raw in env.items():
        if key.startswith(ENV_PREFIX):
            field = key[len(ENV_PREFIX):].lower()
            if field not in FIELDS:
                raise ConfigError(f"unknown config field '{field}' (from environment variable {key})")
            data[field] = _parse_env_value(field, raw)
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return _convert(data)


def dump_config(config: Config) -> str:
    """The config as TOML text (what a launcher hands to the processes it starts)."""
    lines = []
    for name in FIELDS:
        value = getattr(config, name)
        lines.append(f"{name} = {_toml_literal(value)}")
    return "\n".join(lines) + "\n"


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
