"""Garbage-collector settings for the engine's long-running step loops (scheduler and worker).

A step allocates a few hundred short-lived objects (outputs, plan entries, staging rows); the default gen-0
threshold (700) would collect almost every step, and a collection that reaches the older generations walks every
object start-up left behind (a torch worker holds hundreds of thousands). Collect rarely instead, and freeze what
start-up allocated so that collections never walk it."""

from __future__ import annotations

import gc

GC_THRESHOLDS = (20_000, 50, 100)


def tune_gc() -> None:
    """Call once start-up is done, before the step loop."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
