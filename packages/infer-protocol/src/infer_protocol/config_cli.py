"""One command-line flag per config field, generated from the `Config` definition (shared by `rustinfer serve` and
the three process CLIs, so every entry point takes the same flags).

`max_model_len` becomes `--max-model-len N`; a bool `--enable-prefix-caching / --no-enable-prefix-caching`; a list
`--capture-sizes 1,2,4` (comma-separated; `""` is the empty list). The help text is the field's Meta description
plus its default. Flags are values above the TOML file and the `RUSTINFER_<FIELD>` variables.

argparse only collects strings here: the values are converted like environment values and then validated by
`load_config`, so `--max-model-len abc` is refused with the same one-line message as `max_model_len = "abc"` in
the file, instead of argparse's usage-and-error style.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import msgspec

from infer_protocol.config import Config, _parse_env_value, _toml_literal, is_text_type, load_config

CONFIG_FLAG = "--config"


@dataclass(frozen=True)
class FieldSpec:
    name: str
    type: msgspec.inspect.Type  # with any Metadata wrapper removed
    default: Any
    description: str  # "" when the definition has none (tests/protocol/test_config_cli.py fails on that)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def field_specs() -> list[FieldSpec]:
    """The config fields in definition order, with their types, defaults and descriptions."""
    defaults = Config()
    specs = []
    info = msgspec.inspect.type_info(Config)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        typ, description = field.type, ""
        while isinstance(typ, msgspec.inspect.Metadata):  # Annotated[T, Meta(...)]; nested Annotated nests these
            description = description or (typ.extra_json_schema or {}).get("description", "")
            typ = typ.type
        specs.append(FieldSpec(field.name, typ, getattr(defaults, field.name), description))
    return specs


def _metavar(typ: msgspec.inspect.Type) -> str:
    if isinstance(typ, msgspec.inspect.LiteralType):
        return "{" + ",".join(str(v) for v in typ.values) + "}"
    if isinstance(typ, msgspec.inspect.ListType):
        return _metavar(typ.item_type) + ",..."
    names = {msgspec.inspect.IntType: "N", msgspec.inspect.FloatType: "X", msgspec.inspect.StrType: "TEXT"}
    return names.get(type(typ), "VALUE")


def _shown(value: Any) -> str:
    if isinstance(value, list):  # as it is typed on the command line
        return ",".join(_shown(v) for v in value) or '""'
    return _toml_literal(value)


def flag_value(spec: FieldSpec, raw: str) -> Any:
    """A flag's string as a config value; the type check is left to `load_config`, as for the file."""
    if is_text_type(spec.type):
        return raw  # a string field takes the text as it is (`--model-name 7` is the name "7")
    if isinstance(spec.type, msgspec.inspect.ListType):
        if raw.lstrip().startswith("["):
            return _parse_env_value(raw)
        return [_parse_env_value(item.strip()) for item in raw.split(",") if item.strip()]
    return _parse_env_value(raw)  # a TOML literal (numbers, and any type a later field brings)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config FILE` and one flag per config field."""
    # A field added later must not change what an abbreviated flag meant (`--model` vs `--model-name`).
    parser.allow_abbrev = False
    parser.add_argument(CONFIG_FLAG, metavar="FILE", help="TOML config file (every field: docs/configuration.md)")
    group = parser.add_argument_group(
        "config fields", "each overrides the TOML file and its RUSTINFER_<FIELD> environment variable")
    for spec in field_specs():
        help_text = f"{spec.description} (default: {_shown(spec.default)})".replace("%", "%%")
        if isinstance(spec.type, msgspec.inspect.BoolType):
            group.add_argument(spec.flag, dest=spec.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(spec.flag, dest=spec.name, metavar=_metavar(spec.type), default=None, help=help_text)


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The fields given on the command line, as config values."""
    overrides = {}
    for spec in field_specs():
        value = getattr(args, spec.name, None)
        if value is not None:
            overrides[spec.name] = value if isinstance(value, bool) else flag_value(spec, value)
    return overrides


def load_config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    """defaults < `--config` file < `RUSTINFER_<FIELD>` < flags; raises ConfigError naming the field."""
    return load_config(args.config, overrides=config_overrides(args), environ=environ)
