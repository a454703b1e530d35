"""TOML config and the versioned msgspec wire messages."""
