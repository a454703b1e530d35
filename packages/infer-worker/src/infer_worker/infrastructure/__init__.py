"""Worker infrastructure layer."""
