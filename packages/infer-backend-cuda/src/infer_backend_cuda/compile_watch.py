"""Triton compiles after start-up, logged: each one stalls the steps of every running request.

Start-up compiles what serving meets (graph capture, the eager batch variants), and later servers read the
compiled kernels from Triton's disk cache; a kernel variant first met while serving costs a compile (~0.1-5 s) on
a machine whose cache lacks it, or a load from the cache otherwise. `watch` listens to Triton's compiler from then
on (`knobs.compilation.listener`: every in-memory cache miss, with its compile times and whether the disk cache
had it) and logs each with the kernel's name, so that a variant that start-up missed shows up in the worker's log
(and in `compiles_while_serving`) instead of as an unexplained latency outlier."""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

log = logging.getLogger("infer_backend_cuda.compile_watch")


class Compile(NamedTuple):
    kernel: str
    seconds: float  # Triton's own timing of the compile (IR, lowering stages, storing the results)
    cache_hit: bool  # loaded from Triton's disk cache rather than compiled


class CompileWatch:
    """A `knobs.compilation.listener`: records and logs each compile it hears of."""

    def __init__(self) -> None:
        self.events: list[Compile] = []
        self._lock = threading.Lock()

    def __call__(self, *, metadata: dict[str, Any], times: Any, cache_hit: bool, **_: Any) -> None:
        try:
            seconds = (times.ir_initialization + sum(d for _, d in times.lowering_stages) + times.store_results) / 1e6
        except (AttributeError, TypeError, ValueError):  # another Triton's timing fields: the compile must go on
            seconds = float("nan")
        event = Compile(str(metadata.get("name", "?")), seconds, bool(cache_hit))
        with self._lock:
            self.events.append(event)
        log.warning("a Triton kernel variant was %s while serving (%.3f s; running requests waited): %s",
                    "loaded from the disk cache" if cache_hit else "compiled", seconds, event.kernel)


_WATCH: CompileWatch | None = None


def watch() -> CompileWatch:
    """Start listening (once; a later call returns the same watch). A listener someone else installed is left in
    place, and nothing is watched then."""
    global _WATCH
    if _WATCH is not None:
        return _WATCH
    from triton import knobs

    _WATCH = CompileWatch()
    if knobs.compilation.listener is None:
        knobs.compilation.listener = _WATCH
    else:
        log.info("a Triton compilation listener is already set: compiles while serving are not logged")
    return _WATCH


def compiles_while_serving() -> list[Compile]:
    """Each compile heard of since `watch`; empty when not watching."""
    return list(_WATCH.events) if _WATCH is not None else []
