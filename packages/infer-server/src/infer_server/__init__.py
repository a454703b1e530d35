"""OpenAI-compatible HTTP front door: templates, tokenizer, SSE."""

from infer_server.app import __version__, create_app
from infer_server.scheduler_client import RequestHandle, SchedulerClient, SchedulerUnavailable

__all__ = ["RequestHandle", "SchedulerClient", "SchedulerUnavailable", "__version__", "create_app"]
