"""The generated flags: one per config field, above the file and the environment, refused like the file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infer_protocol.config import Config, ConfigError, load_config
from infer_protocol.config_cli import FieldSpec, add_config_arguments, field_specs, load_config_from_args

# Fields whose type-generic example below would be refused or would not differ from the default.
EXAMPLES: dict[str, tuple[list[str], Any]] = {
    "api_key": (["--api-key", "12345,key-2"], "12345,key-2"),  # str | list[str]: the text as typed (digits too)
}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser.parse_args(argv)


def _example(spec: FieldSpec) -> tuple[list[str], Any]:
    """A flag setting the field to a valid value other than its default, and that value."""
    if spec.name in EXAMPLES:
        return EXAMPLES[spec.name]
    t = spec.type
    if isinstance(t, msgspec.inspect.BoolType):
        return ([spec.flag] if not spec.default else ["--no-" + spec.flag[2:]]), not spec.default
    if isinstance(t, msgspec.inspect.LiteralType):
        value = next(v for v in t.values if v != spec.default)
        return [spec.flag, str(value)], value
    if isinstance(t, msgspec.inspect.StrType):
        return [spec.flag, "flag-value"], "flag-value"
    if isinstance(t, msgspec.inspect.IntType):
        return [spec.flag, str(spec.default + 1)], spec.default + 1
    if isinstance(t, msgspec.inspect.FloatType):
        return [spec.flag, str(spec.default / 2)], spec.default / 2
    if isinstance(t, msgspec.inspect.ListType) and isinstance(t.item_type, msgspec.inspect.IntType):
        return [spec.flag, "3,5"], [3, 5]
    raise AssertionError(f"no example value for config field {spec.name!r} of type {t}: add one to EXAMPLES")


def test_every_field_has_a_description() -> None:
    missing = [s.name for s in field_specs() if not s.description]
    assert missing == [], "give these Config fields an Annotated[..., Meta(description=...)]"


@pytest.mark.parametrize("spec", field_specs(), ids=lambda s: s.name)
def test_every_field_has_a_flag(spec: FieldSpec) -> None:
    argv, expected = _example(spec)
    assert spec.name in EXAMPLES or expected != spec.default
    cfg = load_config_from_args(_parse(argv), environ={})
    assert getattr(cfg, spec.name) == expected
    assert msgspec.structs.replace(cfg, **{spec.name: spec.default}) == Config()  # and nothing else changed


def test_field_specs_follow_the_definition() -> None:
    assert [s.name for s in field_specs()] == list(Config.__struct_fields__)
    assert [s.flag for s in field_specs()][:3] == ["--model", "--revision", "--model-name"]


def test_list_flags() -> None:
    assert load_config_from_args(_parse(["--capture-tokens", ""]), environ={}).capture_tokens == []
    assert load_config_from_args(_parse(["--capture-sizes", "[2, 4]"]), environ={}).capture_sizes == [2, 4]
    assert load_config_from_args(_parse(["--capture-sizes", "8, 16,"]), environ={}).capture_sizes == [8, 16]


def test_string_flags_are_taken_as_they_are() -> None:
    cfg = load_config_from_args(_parse(["--model-name", "7", "--cluster-id", "true"]), environ={})
    assert (cfg.model_name, cfg.cluster_id) == ("7", "true")


def test_flags_beat_env_and_env_beats_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("max_batch_seqs = 8\nmax_model_len = 100\nblock_size = 32\nenable_overlap = true\n")
    env = {"RUSTINFER_MAX_BATCH_SEQS": "16", "RUSTINFER_MAX_MODEL_LEN": "200", "RUSTINFER_ENABLE_OVERLAP": "true"}
    args = _parse(["--config", str(path), "--max-batch-seqs", "64", "--no-enable-overlap"])
    cfg = load_config_from_args(args, environ=env)
    assert (cfg.max_batch_seqs, cfg.enable_overlap) == (64, False)  # flag > env > TOML
    assert cfg.max_model_len == 200  # env > TOML
    assert cfg.block_size == 32  # TOML > default


@pytest.mark.parametrize(
    ("argv", "toml"),
    [
        (["--max-model-len", "abc"], 'max_model_len = "abc"'),
        (["--port", "0"], "port = 0"),
        (["--mem-fraction-static", "1.5"], "mem_fraction_static = 1.5"),
        (["--log-level", "loud"], 'log_level = "loud"'),
        (["--capture-sizes", "1,x"], 'capture_sizes = [1, "x"]'),
        (["--cluster-id", "a/b"], 'cluster_id = "a/b"'),
    ],
)
def test_a_bad_flag_is_refused_like_the_file(tmp_path: Path, argv: list[str], toml: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError) as from_file:
        load_config(path, environ={})
    with pytest.raises(ConfigError) as from_flag:
        load_config_from_args(_parse(argv), environ={})
    assert str(from_flag.value) == str(from_file.value)
    assert "\n" not in str(from_flag.value) and toml.split(" ")[0] in str(from_flag.value)
