"""Load from several client processes started together: one Python process reading hundreds of streams is CPU-bound
and would pace (or burst) what it measures. Imported as a sibling module by the benches."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from typing import Any, Callable, Sequence

HEAD_START_S = 2.0  # spawned processes import their bench before the common start


def start_time(clients: int) -> float:
    """The wall-clock time every client process starts its load at: now for one in-process client."""
    return time.time() + (HEAD_START_S if clients > 1 else 0.0)


def run_in_processes(fn: Callable[..., Any], arg_lists: Sequence[tuple[Any, ...]]) -> list[Any]:
    """`fn(*args)` for each args in a spawned process of its own, all at once; the results in order. `fn` must be a
    module-level function of a script run as a file (spawn imports it again)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(arg_lists), mp_context=ctx) as pool:
        futures = [pool.submit(fn, *args) for args in arg_lists]
        return [f.result() for f in futures]
