"""The kernel ranking shared by the profiling benches: a torch.profiler run's events by total time, printed as a
short table. Imported as a sibling module (the benches run as scripts from the repository root)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.autograd import DeviceType


def ranked(
    prof: torch.profiler.profile, top: int, on_device: bool, kernels_only: bool = False
) -> tuple[list[dict], float]:
    """(the `top` events by total time, the self time of all of them in ms). `on_device` ranks by device time;
    `kernels_only` keeps the device's own events (kernels, memcpy, memset), not the host ops that launched them
    (whose device totals repeat their kernels')."""
    key = "device_time_total" if on_device else "cpu_time_total"
    events = [e for e in prof.key_averages()
              if not kernels_only or getattr(e, "device_type", None) == DeviceType.CUDA]
    events.sort(key=lambda e: getattr(e, key, 0.0), reverse=True)
    total = sum(getattr(e, "self_device_time_total" if on_device else "self_cpu_time_total", 0.0) for e in events)
    rows = [{"name": e.key[:90], "calls": e.count, "total_ms": getattr(e, key, 0.0) / 1e3} for e in events[:top]]
    return rows, total / 1e3


def print_ranked(rows: list[dict], total_ms: float, what: str = "kernel / op") -> None:
    print(f"{'total ms':>10} {'calls':>7}  {what}  (self time of all: {total_ms:.1f} ms)")
    for r in rows:
        print(f"{r['total_ms']:>10.2f} {r['calls']:>7}  {r['name']}")


STEP_GAP_US = 100.0  # idle device time that separates two steps of a bench loop (the host's work between them)


def device_timeline(trace: Path) -> dict:
    """A chrome trace's device work (kernels, memcpy, memset) as a timeline summary: the span from the first start to
    the last end, the time some kernel ran (the union over streams), the idle rest, the gaps over 2 us (count and
    total), each stream's busy time, and the steps' device spans (work with a kernel in it, separated by more than
    STEP_GAP_US idle: a bench loop's steps, their host preparation excluded, not an input copy issued ahead alone).
    Where a step's time goes that kernel totals cannot say: idle dependency waits at a graph's fork / join, or
    kernels stretched by sharing the SMs."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return {}
    events.sort(key=lambda e: e["ts"])
    busy, gaps, end = 0.0, [], events[0]["ts"]
    streams: dict[str, float] = {}
    clusters, step_start, kernels = [], events[0]["ts"], False
    for e in events:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:
            gaps.append(start - end)
            if start - end > STEP_GAP_US:
                clusters.append((end - step_start, kernels))
                step_start, kernels = start, False
        kernels |= e["cat"] == "kernel"
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        stream = str(e.get("args", {}).get("stream", e.get("tid")))
        streams[stream] = streams.get(stream, 0.0) + e["dur"]
    clusters.append((end - step_start, kernels))
    step_spans = [length for length, with_kernels in clusters if with_kernels]  # not a lone input copy
    span = end - events[0]["ts"]
    big = [g for g in gaps if g > 2.0 and g <= STEP_GAP_US]
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "gaps_over_2us": len(big),
            "gaps_over_2us_total_us": sum(big), "stream_busy_us": streams, "events": len(events),
            "step_spans_us": step_spans}
