"""GPU time per call from CUDA-graph replays, shared by the kernel benchmark scripts of this folder."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_replay_us(call: Callable[[int], object], calls: int, reps: int = 20) -> float:
    """Microseconds of GPU time per call: `call(0) .. call(calls - 1)` captured in one graph (each warmed up first,
    and once more on a side stream as the torch docs recommend), the median of `reps` replays / `calls`."""
    for i in range(calls):
        call(i)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
