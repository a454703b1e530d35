"""OpenAI-compatible HTTP front door: templates, tokenizer, SSE."""
