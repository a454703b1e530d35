"""Worker domain layer."""
