"""Worker models layer."""
