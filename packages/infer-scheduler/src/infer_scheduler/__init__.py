"""Continuous batching, paged KV block allocator, prefix cache."""
