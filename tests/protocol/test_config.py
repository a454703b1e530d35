from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from infer_protocol.config import FIELDS, Config, ConfigError, dump_config, load_config

REQUIRED_FIELDS = {
    "model", "model_name", "backend", "device", "host", "port", "max_batch_tokens", "max_batch_seqs", "max_model_len",
    "chunked_prefill_size", "enable_prefix_caching", "mem_fraction_static", "num_blocks", "block_size",
    "capture_sizes", "tensor_parallel_size", "ignore_eos", "load_format", "cluster_id", "log_level",
    "request_timeout_secs", "worker_timeout_secs",
}


def test_every_documented_field_exists() -> None:
    assert REQUIRED_FIELDS <= set(FIELDS)


def test_every_field_is_documented_with_its_default() -> None:
    """docs/configuration.md has one table row per field, `| `name` | `default` | meaning |`, whose default (a TOML
    literal) is the code's: the doc cannot drift from the definition."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", doc, flags=re.MULTILINE)
    documented: dict[str, list[str]] = {}
    for name, default in rows:
        documented.setdefault(name, []).append(default)
    defaults = Config()
    for name in FIELDS:
        assert len(documented.get(name, [])) == 1, f"config field {name!r}: want one row in docs/configuration.md"
        doc_default = tomllib.loads(f"v = {documented[name][0]}")["v"]
        code_default = getattr(defaults, name)
        assert (doc_default, type(doc_default) is bool) == (code_default, type(code_default) is bool), name


def test_file_env_and_overrides_in_order(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('port = 9001\nmax_batch_seqs = 8\ncapture_sizes = [1, 2]\nmodel_name = "m"\n')
    env = {"RUSTINFER_MAX_BATCH_SEQS": "16", "RUSTINFER_ENABLE_PREFIX_CACHING": "false", "RUSTINFER_MODEL": "/x y"}
    cfg = load_config(path, overrides={"port": 9002, "host": None}, environ=env)
    assert (cfg.port, cfg.max_batch_seqs, cfg.capture_sizes, cfg.model_name) == (9002, 16, [1, 2], "m")
    assert cfg.enable_prefix_caching is False and cfg.model == "/x y" and cfg.host == "127.0.0.1"


def test_string_fields_take_environment_text_as_it_is() -> None:
    """A model named 7, a key that looks like a boolean, a dtype: strings; numbers and lists still parse."""
    env = {"RUSTINFER_MODEL_NAME": "7", "RUSTINFER_API_KEY": "true", "RUSTINFER_DTYPE": "float16",
           "RUSTINFER_PORT": "9005", "RUSTINFER_CAPTURE_SIZES": "[1, 4]"}
    cfg = load_config(environ=env)
    assert (cfg.model_name, cfg.api_key, cfg.dtype) == ("7", "true", "float16")
    assert (cfg.port, cfg.capture_sizes) == (9005, [1, 4])


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("colour = 1", "colour"),
        ("port = 0", "port"),
        ('port = "x"', "port"),
        ("mem_fraction_static = 1.5", "mem_fraction_static"),
        ('load_format = "pt"', "load_format"),
        ("block_size = -16", "block_size"),
        ("capture_sizes = [0, 1]", "capture_sizes"),
        ('cluster_id = "a/b"', "cluster_id"),
    ],
)
def test_invalid_fields_are_refused_by_name(tmp_path: Path, toml: str, field: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError, match=field):
        load_config(path, environ={})


def test_unknown_environment_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="RUSTINFER_NOPE"):
        load_config(environ={"RUSTINFER_NOPE": "1"})


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, environ={})


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(overrides={"model": 'we"ird\\path', "capture_sizes": [1, 3], "mem_fraction_static": 0.5}, environ={})
    path = tmp_path / "out.toml"
    path.write_text(dump_config(cfg))
    assert load_config(path, environ={}) == cfg


def test_ipc_paths_are_per_cluster(tmp_path: Path) -> None:
    a = Config(cluster_id="a", ipc_dir=str(tmp_path))
    b = Config(cluster_id="b", ipc_dir=str(tmp_path))
    assert a.ipc_path("sched") != b.ipc_path("sched")
    assert a.ipc_path("sched").startswith("ipc://" + str(tmp_path))
