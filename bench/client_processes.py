"""Load from several client processes started together: one Python process reading hundreds of streams is CPU-bound
and would pace (or burst) what it measures. Imported as a sibling module by the benches."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import time
from collections.abc import AsyncIterator
from typing import Any, Callable, Sequence

import httpx

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


@contextlib.asynccontextmanager
async def load_client(url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client for a load of many concurrent streams (no timeout, no connection limit), its set-up done: a process's
    first request pays httpx's own set-up and a connection (~0.1 s, measured), which a request timed from the start
    of the load would count as the server's time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        await client.get(f"{url}/health")
        yield client
