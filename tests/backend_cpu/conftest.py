"""One torch thread per module in this folder (see tests/torch_threads.py)."""

from tests.torch_threads import single_torch_thread  # noqa: F401
