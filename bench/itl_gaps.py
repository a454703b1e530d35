"""Where a sweep's long inter-token gaps come from, from its per-request timelines (`serve_sweep.py --timeline`).

A gap is long when it exceeds `factor` x the level's median gap. Each long gap is classed by what else happened
while it was open:
- beside a prefill: another request's first token arrived inside the gap (the step that produced it also ran
  that request's prompt, so every running stream waited for it);
- shared: no first token inside, but another running stream saw a long gap ending within `window` of this one
  (a slow or late step on the server, seen by everyone);
- alone: neither (the client or the connection of this stream alone: a late read, chunks delivered together).
"""
from __future__ import annotations

import bisect
from typing import TypedDict


class Timeline(TypedDict):
    sent: float  # wall-clock time the request was sent (s)
    ttft: float  # s after `sent`
    itl: list[float]  # the gaps after the first token (s)


class GapReport(TypedDict):
    gaps: int
    median_ms: float
    threshold_ms: float
    long: int
    beside_prefill: int
    shared: int
    alone: int


def token_times(t: Timeline) -> list[float]:
    """The wall-clock arrival time of each streamed token of one request."""
    times = [t["sent"] + t["ttft"]]
    for gap in t["itl"]:
        times.append(times[-1] + gap)
    return times


def classify(timelines: list[Timeline], factor: float = 2.0, window: float = 1e-3) -> GapReport:
    """Count the long gaps of `timelines` by cause (module docstring)."""
    all_gaps = sorted(g for t in timelines for g in t["itl"])
    if not all_gaps:
        return GapReport(gaps=0, median_ms=float("nan"), threshold_ms=float("nan"), long=0, beside_prefill=0,
                         shared=0, alone=0)
    median = all_gaps[len(all_gaps) // 2]
    threshold = factor * median
    firsts = sorted((t["sent"] + t["ttft"], i) for i, t in enumerate(timelines))
    first_times = [f for f, _ in firsts]
    long_gaps: list[tuple[float, float, int]] = []  # (start, end, request)
    for i, t in enumerate(timelines):
        times = token_times(t)
        long_gaps.extend((times[k], times[k + 1], i) for k, gap in enumerate(t["itl"]) if gap > threshold)
    ends = sorted((end, i) for _, end, i in long_gaps)
    end_times = [e for e, _ in ends]
    beside = shared = 0
    for start, end, i in long_gaps:
        lo, hi = bisect.bisect_right(first_times, start), bisect.bisect_right(first_times, end)
        if any(firsts[j][1] != i for j in range(lo, hi)):
            beside += 1
            continue
        lo, hi = bisect.bisect_left(end_times, end - window), bisect.bisect_right(end_times, end + window)
        if any(ends[j][1] != i for j in range(lo, hi)):
            shared += 1
    return GapReport(gaps=len(all_gaps), median_ms=median * 1e3, threshold_ms=threshold * 1e3, long=len(long_gaps),
                     beside_prefill=beside, shared=shared, alone=len(long_gaps) - beside - shared)


def describe(report: GapReport) -> str:
    if not report["long"]:
        return f"no gap above {report['threshold_ms']:.2f} ms of {report['gaps']}"
    share = 100 / report["long"]
    return (f"{report['long']} of {report['gaps']} gaps above {report['threshold_ms']:.2f} ms "
            f"({100 * report['long'] / report['gaps']:.2f} %): beside another's prefill "
            f"{report['beside_prefill'] * share:.0f} %, shared with other streams {report['shared'] * share:.0f} %, "
            f"alone {report['alone'] * share:.0f} %")
