"""Worker application layer."""
