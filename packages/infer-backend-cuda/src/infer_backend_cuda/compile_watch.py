"""Triton compiles after start-up, logged: each one stalls the steps of every running request.

Start-up compiles what serving meets (graph capture, the eager batch variants), and later servers read the
compiled kernels from Triton's disk cache; a kernel variant first met while serving costs a compile (~0.1-5 s) on
a machine whose cache lacks it, or a load from the cache otherwise. `watch` times every JIT cache miss from then on
through Triton's compile hooks and logs it with the kernel's name, so that a variant that start-up missed shows up
in the worker's log (and in `compiles_while_serving`) instead of as an unexplained latency outlier."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("infer_backend_cuda.compile_watch")


class CompileWatch:
    """Hook callables for `triton.knobs.runtime` (`jit_cache_hook` before a compile, `jit_post_compile_hook`
    after it); `events` holds (kernel name, seconds) of each compile seen."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self._started: dict[tuple[int, str], float] = {}
        self._lock = threading.Lock()

    def before(self, *, fn: Any, **_: Any) -> bool:
        with self._lock:
            self._started[(threading.get_ident(), fn.name)] = time.perf_counter()
        return False  # never skip the compile

    def after(self, *, fn: Any, repr: str, **_: Any) -> None:  # noqa: A002 - Triton's keyword
        with self._lock:
            started = self._started.pop((threading.get_ident(), fn.name), None)
            seconds = time.perf_counter() - started if started is not None else float("nan")
            self.events.append((fn.name, seconds))
        log.warning("a Triton kernel variant compiled while serving (%.3f s; running requests waited): %s",
                    seconds, repr)


_WATCH: CompileWatch | None = None


def watch() -> CompileWatch:
    """Install the hooks (once; a later call returns the same watch). A hook already installed by someone else
    is left in place and nothing is watched."""
    global _WATCH
    if _WATCH is not None:
        return _WATCH
    from triton import knobs

    _WATCH = CompileWatch()
    runtime = knobs.runtime
    if runtime.jit_cache_hook is None and runtime.jit_post_compile_hook is None:
        runtime.jit_cache_hook = _WATCH.before
        runtime.jit_post_compile_hook = _WATCH.after
    else:
        log.info("Triton compile hooks already set: compiles while serving are not logged")
    return _WATCH


def compiles_while_serving() -> list[tuple[str, float]]:
    """(kernel name, seconds) of each compile since `watch`; empty when not watching."""
    return list(_WATCH.events) if _WATCH is not None else []
