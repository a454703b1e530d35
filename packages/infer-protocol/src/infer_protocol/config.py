"""The one TOML config shared by all three processes.

Precedence: defaults < TOML file < `RUSTINFER_<FIELD>` environment variables < explicit CLI overrides.
Unknown or invalid fields are refused with a message naming the field.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

ENV_PREFIX = "RUSTINFER_"
_HUB_REPO_ID = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*")  # owner/name; huggingface_hub checks the finer rules


class ConfigError(ValueError):
    """A config file, environment variable or override is unknown or invalid (the message names the field)."""


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Each field's meaning is its Meta description: the CLI flags' --help and the description test read it there
    # (a field without one still gets a flag, but tests/protocol/test_config_cli.py fails until it has one).
    # model
    model: Annotated[str, Meta(description="Hugging Face model directory or Hub repo id (owner/name); "
                                           "empty = the embedded SmolLM2-135M-Instruct")] = ""
    revision: Annotated[str, Meta(
        description="branch, tag or commit when model is a Hub repo id; empty = main")] = ""
    model_name: Annotated[str, Meta(
        description="model id served at /v1/models; empty = the Hub repo id or the directory's name")] = ""
    load_format: Annotated[Literal["auto", "dummy"], Meta(
        description="auto reads the checkpoint; dummy builds random weights from config.json")] = "auto"
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Meta(
        description="auto = the backend's preference (float32 on CPU, bfloat16 on CUDA)")] = "auto"
    seed: Annotated[int, Meta(description="seed for dummy weights")] = 0
    generation_config: Annotated[Literal["auto", "none"], Meta(
        description="auto: the sampling fields of the model's generation_config.json are the request defaults; "
                    "none: OpenAI's defaults")] = "auto"
    # backend
    backend: Annotated[str, Meta(
        description="auto, cpu, cuda or any name in the rustinfer.backends entry point group")] = "auto"
    device: Annotated[str, Meta(description="torch device string (cpu, cuda:0); empty = the backend's default")] = ""
    tensor_parallel_size: Annotated[int, Meta(
        description="tensor-parallel degree: this many worker ranks (processes) shard the model; on CUDA they use "
                    "consecutive devices from device")] = 1
    tp_operation_timeout_secs: Annotated[float, Meta(
        description="with tensor_parallel_size > 1: a collective or step-plan broadcast between the ranks that "
                    "takes longer stops the whole rank group (fail-stop)")] = 60.0
    tp_startup_timeout_secs: Annotated[float, Meta(
        description="with tensor_parallel_size > 1: every rank must have joined the group and loaded its shard "
                    "within this long")] = 600.0
    # HTTP
    host: Annotated[str, Meta(description="address the HTTP server binds")] = "127.0.0.1"
    port: Annotated[int, Meta(description="port of the HTTP server")] = 8000
    max_inflight_requests: Annotated[int, Meta(
        description="requests beyond this many in flight are answered 429")] = 1024
    max_request_body_bytes: Annotated[int, Meta(description="larger request bodies are answered 413")] = 4 * 1024 * 1024
    enable_console: Annotated[bool, Meta(
        description="serve the browser console at / when infer-frontend is installed")] = True
    server_processes: Annotated[int, Meta(
        description="HTTP processes sharing the port (SO_REUSEPORT): streaming is Python work per token")] = 1
    request_body_timeout_secs: Annotated[float, Meta(
        description="a request body not fully received this long after its headers is answered 408")] = 30.0
    api_key: Annotated[str | list[str], Meta(
        description="API key(s), a list or comma-separated; empty = no auth, else Authorization: Bearer <key> "
                    "on /v1/*, /tokenize and /detokenize")] = ""
    api_key_protects_metrics: Annotated[bool, Meta(
        description="with api_key: /metrics and /metrics/system need the key too")] = False
    allow_special_tokens_in_content: Annotated[bool, Meta(
        description="chat content may write control tokens such as <|im_end|> (unsafe: forged turns)")] = False
    # images (chat content parts of type image_url, for a model whose config.json declares a vision_config)
    max_images_per_request: Annotated[int, Meta(
        description="chat requests with more image parts are answered 400")] = 8
    max_image_bytes: Annotated[int, Meta(
        description="an image's encoded size limit (a data URL's decoded bytes, or a fetched body); larger: 400")] = \
        10 * 1024 * 1024
    max_image_pixels: Annotated[int, Meta(
        description="an image's decoded width x height limit (decompression bombs); larger: 400")] = 4096 * 4096
    allow_image_urls: Annotated[bool, Meta(
        description="fetch http(s) image URLs (off by default: no server-side requests, so no SSRF); "
                    "else only data: URLs are served")] = False
    image_url_timeout_secs: Annotated[float, Meta(
        description="with allow_image_urls: the time limit of one image fetch (connect to last byte)")] = 10.0
    tool_call_parser: Annotated[Literal["auto", "hermes", "llama3_json", "none"], Meta(
        description="how tool calls are read from the output: hermes (<tool_call>{...}</tool_call>), llama3_json "
                    "({\"name\", \"parameters\"}), none (tools refused), auto (from the chat template's text)")] = "auto"
    # scheduling
    max_batch_tokens: Annotated[int, Meta(
        description="token budget of one step (decode tokens + prefill chunk tokens)")] = 8192
    max_batch_seqs: Annotated[int, Meta(description="at most this many sequences in one step")] = 256
    max_model_len: Annotated[int, Meta(
        description="context limit (prompt + completion); 0 = the model's max_position_embeddings")] = 0
    chunked_prefill_size: Annotated[int, Meta(
        description="at most this many prompt tokens of one request per step")] = 2048
    prefill_tokens_while_decoding: Annotated[int, Meta(
        description="while any request decodes, a step carries at most this many prompt tokens (bounds the "
                    "inter-token latency a long prompt adds); 0 = no cap beyond max_batch_tokens")] = 0
    idle_prefill_uses_step_budget: Annotated[bool, Meta(
        description="while no request decodes, one request's prefill chunk may take the whole step budget "
                    "(max_batch_tokens) instead of chunked_prefill_size: a lone long prompt prefills in fewer, "
                    "larger steps (vLLM's behaviour); false = chunks of chunked_prefill_size always")] = True
    enable_prefix_caching: Annotated[bool, Meta(
        description="RadixTree prefix cache: reuse the KV of shared, page-aligned prompt prefixes")] = True
    enable_overlap: Annotated[bool, Meta(
        description="plan step k+1 before step k's tokens are back (one step ahead); false = synchronous")] = True
    plan_slack_ms: Annotated[float, Meta(
        description="with enable_overlap: hold the next step's plan until this many ms (beyond the measured "
                    "planning and worker launch times) before the running step is predicted to end, so that a "
                    "request arriving meanwhile joins the next step rather than the one after; 0 = send it as "
                    "soon as a step starts")] = 1.0
    ignore_eos: Annotated[bool, Meta(description="default for requests: keep generating past EOS (benchmarks)")] = False
    # KV cache
    mem_fraction_static: Annotated[float, Meta(
        description="on a GPU: the share of device memory the engine may use (weights, activations, KV cache)")] = 0.85
    num_blocks: Annotated[int, Meta(description="KV cache blocks; 0 = sized from a memory profile")] = 0
    block_size: Annotated[int, Meta(description="tokens per KV block (page)")] = 16
    cpu_kv_cache_bytes: Annotated[int, Meta(
        description="KV cache budget on the CPU backend when num_blocks = 0")] = 1 << 30
    # CUDA graphs
    # a batch runs the graph of the next size up: steps between sizes bound the padding (<= 25% from 32 up)
    capture_sizes: Annotated[list[int], Meta(
        description="decode batch sizes captured as CUDA graphs; a batch is padded to the next size")] = msgspec.field(
        default_factory=lambda: [1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 224, 256])
    # mixed steps (prefill chunks, with or without decodes) of up to this many tokens replay CUDA graphs too
    capture_tokens: Annotated[list[int], Meta(
        description="token buckets of the CUDA graphs for mixed (prefill) steps; empty = decode graphs only")] = (
        msgspec.field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048]))
    mixed_graph_chunk_seqs: Annotated[int, Meta(
        description="the mixed-step graphs assume at most this many prompt chunks a step and size the prefill "
                    "attention's grid by them; a step with more runs eagerly. 0 = no bound (the grid counts every "
                    "sequence of the graph's bucket)")] = 8
    enable_cuda_graphs: Annotated[bool, Meta(description="capture and replay CUDA graphs")] = True
    # processes
    cluster_id: Annotated[str, Meta(
        description="names the ZMQ IPC sockets: several clusters on one machine need different ids")] = "default"
    ipc_dir: Annotated[str, Meta(description="directory of the IPC socket files; empty = the system temp dir")] = ""
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Meta(description="log level")] = "info"
    # supervision by `rustinfer serve`: a worker that dies is restarted, a bounded number of times
    worker_max_restarts: Annotated[int, Meta(
        description="worker restarts allowed within worker_restart_window_secs; one more death stops serve "
                    "(0 = never restart)")] = 3
    worker_restart_window_secs: Annotated[float, Meta(
        description="a restart older than this no longer counts against worker_max_restarts")] = 60.0
    worker_restart_backoff_secs: Annotated[float, Meta(
        description="delay before the first restart in the window; doubles with each next one")] = 1.0
    # timeouts (seconds)
    request_timeout_secs: Annotated[float, Meta(
        description="a request running longer is ended (504, or an error event when streaming)")] = 600.0
    ready_timeout_secs: Annotated[float, Meta(
        description="rustinfer serve gives up if the cluster is not ready by then")] = 600.0
    heartbeat_interval_secs: Annotated[float, Meta(
        description="worker heartbeats and server pings are sent this often")] = 0.5
    worker_timeout_secs: Annotated[float, Meta(
        description="no heartbeat for this long = the worker is lost")] = 30.0
    scheduler_timeout_secs: Annotated[float, Meta(
        description="no pong for this long = the scheduler is lost")] = 5.0
    shutdown_timeout_secs: Annotated[float, Meta(
        description="grace period for draining on SIGTERM before processes are killed")] = 10.0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys: `api_key` as a list, or a comma-separated string (`RUSTINFER_API_KEY=k1,k2`)."""
        given = self.api_key.split(",") if isinstance(self.api_key, str) else self.api_key
        return tuple(k.strip() for k in given if k.strip())

    def ipc_path(self, channel: str) -> str:
        """The ZMQ IPC address of one channel (`sched`, `plan`, `result`), unique per cluster_id."""
        base = Path(self.ipc_dir or tempfile.gettempdir())
        return f"ipc://{base / f'rustinfer-{self.cluster_id}-{channel}.ipc'}"


def ipc_listener(address: str) -> bool:
    """Whether a process listens on a ZMQ `ipc://` address: its socket file exists and takes a connection (a file
    that takes none is a dead process's leftover). Another cluster's scheduler on the same `cluster_id` shows here."""
    if not address.startswith("ipc://"):
        return False
    path = address[len("ipc://"):]
    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"config field '{name}' must be > 0, got {value!r}")


def _validate(c: Config) -> None:
    for name in ("max_batch_tokens", "max_batch_seqs", "chunked_prefill_size", "block_size", "tensor_parallel_size",
                 "max_inflight_requests", "max_request_body_bytes", "request_timeout_secs", "ready_timeout_secs",
                 "heartbeat_interval_secs", "worker_timeout_secs", "scheduler_timeout_secs", "cpu_kv_cache_bytes",
                 "worker_restart_window_secs", "max_images_per_request", "max_image_bytes",
                 "max_image_pixels", "image_url_timeout_secs", "tp_operation_timeout_secs",
                 "tp_startup_timeout_secs"):
        _positive(name, getattr(c, name))
    _positive("request_body_timeout_secs", c.request_body_timeout_secs)
    for name in ("max_model_len", "num_blocks", "seed", "worker_max_restarts", "worker_restart_backoff_secs",
                 "prefill_tokens_while_decoding", "plan_slack_ms", "mixed_graph_chunk_seqs"):
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


FIELDS: tuple[str, ...] = Config.__struct_fields__


def hub_repo_id(model: str) -> str | None:
    """`model` as a Hugging Face Hub repo id, or None: empty (the embedded model), an existing directory (a
    directory wins over a Hub id of the same spelling) or not shaped like `owner/name`."""
    if not model or os.path.isdir(os.path.expanduser(model)):
        return None
    return model if _HUB_REPO_ID.fullmatch(model) else None


def is_text_type(typ: msgspec.inspect.Type) -> bool:
    """A field type that takes text as it is: a string, a union with one (`str | list[str]`, api_key: the text,
    comma-separated), or string literals."""
    if isinstance(typ, msgspec.inspect.Metadata):
        return is_text_type(typ.type)
    if isinstance(typ, msgspec.inspect.StrType):
        return True
    if isinstance(typ, msgspec.inspect.UnionType):
        return any(isinstance(t, msgspec.inspect.StrType) for t in typ.types)
    return isinstance(typ, msgspec.inspect.LiteralType) and all(isinstance(v, str) for v in typ.values)


def _parse_env_value(raw: str) -> Any:
    """A TOML literal (`8`, `true`, `[1, 2]`); anything else is taken as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


_info = msgspec.inspect.type_info(Config)
assert isinstance(_info, msgspec.inspect.StructType)
# Their environment values are text as it is: `RUSTINFER_MODEL_NAME=7` names the model "7", not the integer 7 —
# unless the type takes a list too (api_key) and the text is a TOML list (`RUSTINFER_API_KEY='["a", "b"]'`).
_TEXT_FIELDS = frozenset(f.name for f in _info.fields if is_text_type(f.type))
_TEXT_OR_LIST_FIELDS = frozenset(
    f.name for f in _info.fields
    if isinstance(getattr(f.type, "type", f.type), msgspec.inspect.UnionType)
    and any(isinstance(t, msgspec.inspect.ListType) for t in getattr(f.type, "type", f.type).types))


def _env_value(field: str, raw: str) -> Any:
    if field in _TEXT_FIELDS and not (field in _TEXT_OR_LIST_FIELDS and raw.lstrip().startswith("[")):
        return raw
    return _parse_env_value(raw)


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
            data[field] = _env_value(field, raw)
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
