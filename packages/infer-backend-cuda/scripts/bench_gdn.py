"""Gated delta rule timings on one GPU at Qwen3.5-4B shapes (16 key / 32 value heads of 128, BF16 inputs), one
GDN layer per call, against the predictions of docs/kernels.md.

Run on the GPU machine:  PYTHONPATH=packages/infer-core/src:packages/infer-backend-cuda/src \
    python3 packages/infer-backend-cuda/scripts/bench_gdn.py
Eager calls timed with CUDA events (mixed and prefill steps of a hybrid model run eagerly), median of 20 after
3 warm-ups; per kernel (recurrent, the chunk-local pass's `gram` and `solve`, sequential `state`) from the torch
profiler, each call synchronised: with PDL a kernel starts early and waits for its predecessor inside, so
back-to-back calls would bill the previous call's state pass to this call's first kernel (the 1.7 ms
"recurrent" time once seen at prefill 8192, where that kernel's programs all exit at once).

Then a decode step's whole mixer (`gated_delta_mix`: conv, gates, recurrence, gated norm) at 1 and 60 rows, the
fused kernel (`kernels/gdn_decode.py`) against the four separate kernels: 24 layers (each its own state pools, as
in the model, so no state stays in L2 between layers) captured in one CUDA graph, as decode steps run."""

from __future__ import annotations

import statistics

import torch

from infer_backend_cuda.gated_delta import CudaGatedDeltaOps
from infer_backend_cuda.kernels import gdn_chunk
from infer_core.ports.linear_attention import GdnLayer, StateBatch

HK, HV, D = 16, 32, 128
dev = "cuda"


def _ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _step(lens: list[int]):
    t = sum(lens)
    q, k = (torch.randn(t, HK, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(t, HV, D, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(t, HV, device=dev) * 0.1
    beta = torch.rand(t, HV, device=dev)
    states = torch.zeros(len(lens) + 1, HV, D, D, device=dev)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32, device=dev)
    slots = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=dev)
    batch = StateBatch(cu, slots, max(lens), all(n == 1 for n in lens))
    return (q, k, v, g, beta), states, batch


KERNELS = {"recurrent": "_gdn_recurrent_kernel", "gram": "_gdn_chunk_gram_kernel",
           "solve": "_gdn_chunk_solve_kernel", "state": "_gdn_chunk_state_kernel"}


def _per_kernel_ms(fn, reps: int = 10) -> dict[str, float]:
    """GPU time per call of each GDN kernel that `fn` launches (torch profiler, averaged over `reps` calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        for tag, name in KERNELS.items():
            if name in evt.key:
                total_us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
                out[tag] = total_us / reps / 1e3
    return out


def main() -> None:
    ops = CudaGatedDeltaOps(dev)
    rows = []
    # Predicted (docs/kernels.md): gram ~0.15-0.3 ms and solve ~0.2-0.3 ms per 8k-token layer call (memory, and
    # the 16-step substitution's latency), the sequential pass ~1.55-1.75 ms at 8k (1.9 measured with tf32x3
    # output products; 128 dependent chunk steps); the recurrent launch of a prefill only exits.
    for name, lens, predicted in (
        ("prefill 8192", [8192], "1.9-2.35 (gram+solve 0.35-0.6)"),
        ("prefill 2048", [2048], "0.55-0.75 (gram+solve 0.08-0.15)"),
        ("mixed 136 + 60 decode", [136] + [1] * 60, "0.13-0.2"),
        ("decode 60", [1] * 60, "0.16 (unchanged)"),
    ):
        args, states, batch = _step(lens)
        total = _ms(lambda: ops.gated_delta_rule(*args, states, batch))
        rows.append((name, total, _per_kernel_ms(lambda: ops.gated_delta_rule(*args, states, batch)), predicted))
    widths = {"recurrent": 10, "gram": 9, "solve": 9, "state": 10}
    print(f"{'step (one GDN layer)':<24}{'ms':>9}" + "".join(f"{t + ' ms':>{w}}" for t, w in widths.items())
          + "  predicted ms")
    for name, total, per, predicted in rows:
        cols = "".join(f"{per[t]:>{w}.3f}" if t in per else f"{'-':>{w}}" for t, w in widths.items())
        print(f"{name:<24}{total:>9.3f}{cols}  {predicted}")
    _state_variants(ops)
    _fused_decode()


def _state_variants(ops) -> None:  # noqa: ANN001
    """The sequential pass at prefill 8192 with 16-column value blocks or 8 warps (it is latency-bound: one 4-warp
    program per SM), its output against the default configuration's."""
    args, states, batch = _step([8192])
    start = states.clone()
    ref = ops.gated_delta_rule(*args, states, batch)
    default = (gdn_chunk.BV, gdn_chunk.STATE_WARPS)
    print(f"{'state pass, prefill 8192':<26}{'state ms':>9}{'max |o - o_default|':>21}")
    for bv, warps in ((16, 4), (32, 8)):
        gdn_chunk.BV, gdn_chunk.STATE_WARPS = bv, warps
        try:
            states.copy_(start)
            diff = (ops.gated_delta_rule(*args, states, batch).float() - ref.float()).abs().max().item()
            ms = _per_kernel_ms(lambda: ops.gated_delta_rule(*args, states, batch), reps=5).get("state", float("nan"))
        finally:
            gdn_chunk.BV, gdn_chunk.STATE_WARPS = default
        print(f"{f'BV {bv}, {warps} warps':<26}{ms:>9.3f}{diff:>21.3g}")


GDN_LAYERS = 24  # Qwen3.5-4B


def _decode_mix_graph(rows: int, fused: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of GDN_LAYERS decode mixers at `rows` sequences; returns it and the last layer's output."""
    gen = torch.Generator(device=dev).manual_seed(0)
    conv_dim = 2 * HK * D + HV * D

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(torch.bfloat16)

    layer = GdnLayer(HK, D, HV, D, rand(conv_dim, 4, scale=0.3), rand(HV, scale=0.5), rand(HV), rand(D), 1e-6)
    ops = CudaGatedDeltaOps(dev, fused_decode=fused)
    pools = ops.allocate_state_pools(GDN_LAYERS, rows + 1, conv_dim, 4, HV, D, D, torch.bfloat16)
    qkv, z, b, a = rand(rows, conv_dim + HV * D + 2 * HV).split((conv_dim, HV * D, HV, HV), dim=-1)
    cu = torch.arange(rows + 1, dtype=torch.int32, device=dev)
    batch = StateBatch(cu, cu[1:].clone(), 1, True)

    def step() -> torch.Tensor:
        out = qkv
        for conv, rec in pools:
            out = ops.gated_delta_mix(qkv, z, b, a, layer, conv, rec, batch)
        return out

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _fused_decode() -> None:
    """us per layer of the decode mixer, graph-replayed. Predicted (docs/kernels.md): at 1 row the fused kernel
    saves ~6-12 us a layer (0.15-0.3 ms a 24-layer step: three launches and the intermediate round trips); at 60
    rows little (the state bytes dominate both)."""
    print(f"{'decode mixer, per layer':<26}{'4 kernels us':>13}{'fused us':>10}{'saved ms/step':>15}"
          f"{'max |fused - 4 kernels|':>25}")
    for rows in (1, 60):
        us, outs = {}, {}
        for fused in (False, True):
            graph, out = _decode_mix_graph(rows, fused)
            us[fused] = _ms(graph.replay) * 1e3 / GDN_LAYERS
            outs[fused] = out.float()
            del graph
        diff = (outs[True] - outs[False]).abs().max().item()  # one replay more of each: the same state history
        saved = (us[False] - us[True]) * GDN_LAYERS / 1e3
        print(f"{f'{rows} rows':<26}{us[False]:>13.2f}{us[True]:>10.2f}{saved:>15.3f}{diff:>25.3g}")


if __name__ == "__main__":
    main()
