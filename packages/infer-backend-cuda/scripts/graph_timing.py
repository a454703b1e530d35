"""GPU time per call from CUDA-graph replays, and the tuners' search over launch configs, shared by the kernel
benchmark scripts of this folder."""

from __future__ import annotations

import statistics
from typing import Callable, Generic, NamedTuple, Sequence, TypeVar

import torch


# Device-to-device copy bandwidth (read + write, B/s) that bench/decode_roofline.py measured on each GPU: the rate of
# the benches' floor columns. H200 4.27 TB/s (2026-11-29), H100 80GB HBM3 3.03 TB/s (twenty-first session).
COPY_BANDWIDTH = {"NVIDIA H200": 4.27e12, "NVIDIA H100 80GB HBM3": 3.03e12}


def copy_bandwidth() -> float:
    """This GPU's copy rate from COPY_BANDWIDTH (the H200's for a GPU it lacks)."""
    return COPY_BANDWIDTH.get(torch.cuda.get_device_name(), COPY_BANDWIDTH["NVIDIA H200"])


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


Config = TypeVar("Config")


def fastest(configs: Sequence[Config], call: Callable[[int, Config], torch.Tensor], reference: torch.Tensor,
            calls: int, rel_tol: float, out_of_time: Callable[[int], bool]) -> tuple[Config | None, float, int]:
    """(best config, its us per call, configs timed): each config's output checked against `reference` (max error
    within `rel_tol` of the reference's largest value, + 0.01), then timed by `graph_replay_us` over `call(0..calls-1,
    config)`; a config that fails to compile, launch or match is skipped. `out_of_time(timed so far)` ends the
    search before the next config."""
    best, best_us, tried = None, float("inf"), 0
    scale = reference.abs().max().item()
    for cfg in configs:
        if out_of_time(tried):
            break
        try:
            err = (call(0, cfg).float() - reference).abs().max().item()
            if err > rel_tol * scale + 1e-2:
                raise RuntimeError(f"wrong result (max err {err})")
            us = graph_replay_us(lambda i: call(i, cfg), calls, reps=15)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile / launch is skipped
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        tried += 1
        if us < best_us:
            best, best_us = cfg, us
    return best, best_us, tried


class Tuned(NamedTuple, Generic[Config]):
    baseline_us: float
    best: Config | None
    best_us: float
    tried: int

    def table_entry(self, **key: object) -> dict | None:
        """A tuned table's entry for this case (`key`: its op, rows and shape), `use` where the best beat the
        baseline; None where no config ran."""
        if self.best is None:
            return None
        return dict(**key, use=self.best_us < self.baseline_us, **self.best._asdict())


def tune_against(baseline: Callable[[int], torch.Tensor], call: Callable[[int, Config], torch.Tensor],
                 configs: Sequence[Config], calls: int, rel_tol: float,
                 out_of_time: Callable[[int], bool]) -> Tuned[Config]:
    """A tuner's case: the baseline timed over `baseline(0..calls-1)`, then `fastest` of `configs`, each checked
    against the baseline's output."""
    baseline_us = graph_replay_us(baseline, calls, reps=15)
    best, best_us, tried = fastest(configs, call, baseline(0).float(), calls, rel_tol, out_of_time)
    return Tuned(baseline_us, best, best_us, tried)
