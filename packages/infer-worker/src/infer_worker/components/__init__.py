"""Worker components layer."""
