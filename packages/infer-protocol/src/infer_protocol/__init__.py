"""TOML config and the versioned msgspec wire messages shared by the three processes."""

from infer_protocol.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
