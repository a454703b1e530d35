"""Per-kernel timings on one GPU at Qwen3-4B shapes (BF16), against the HBM byte floor of docs/kernels.md.

Run on the GPU machine:  PYTHONPATH=packages/infer-core/src:packages/infer-backend-cuda/src \
    python3 packages/infer-backend-cuda/scripts/bench_kernels.py [--json out.json]
Two times per kernel: `eager_us` = back-to-back eager calls (max of the Python launch cost and the GPU
time), `graph_us` = the same calls captured in a CUDA graph and replayed (GPU time, L2 warm for small
operands). `--sweep` also times launch configurations of the attention kernels."""

from __future__ import annotations

import argparse
import json

import torch
import triton

from graph_timing import copy_bandwidth, graph_replay_us
from infer_backend_cuda import kernels as K
from infer_backend_cuda import numba_kernels
from infer_backend_cuda.sampler import CudaSampler, cut_thresholds
from infer_core.ports.sampler import SamplingBatch

H, I, HQ, HKV, D, V, BS = 2560, 9728, 32, 8, 128, 151936, 16
dev = "cuda"
bf = torch.bfloat16


def bench(fn, calls: int = 10, reps: int = 20) -> tuple[float, float]:
    """(eager us per call, graph-replay us per call), medians over repetitions."""
    import statistics
    import time

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    eager = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls * 4):
            fn()
        torch.cuda.synchronize()
        eager.append((time.perf_counter() - t0) / (calls * 4) * 1e6)
    return statistics.median(eager), graph_replay_us(lambda _: fn(), calls, reps)


def paged(batch, ctx):
    pages = (ctx + BS - 1) // BS
    nb = batch * pages + 1
    kc = torch.randn((nb, BS, HKV, D), device=dev, dtype=bf)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb - 1, device=dev)[: batch * pages].view(batch, pages).to(torch.int32)
    return kc, vc, bt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows = []

    def add(name, t, nbytes, flops=0.0):
        eager, us = t
        rows.append(dict(kernel=name, eager_us=round(eager, 2), graph_us=round(us, 2), floor_us=round(nbytes / copy_bandwidth() * 1e6, 2), gbps=round(nbytes / us / 1e3, 1), tflops=round(flops / us / 1e6, 1)))

    for T in (1, 64, 2048):
        x = torch.randn((T, H), device=dev, dtype=bf)
        r = torch.randn_like(x)
        w = torch.randn(H, device=dev, dtype=bf)
        add(f"rms_norm T={T}", bench(lambda: K.rms_norm(x, w, 1e-6)), 2 * T * H * 2)
        add(f"add_rms_norm T={T}", bench(lambda: K.add_rms_norm(x, r, w, 1e-6)), 4 * T * H * 2)
        gu = torch.randn((T, 2 * I), device=dev, dtype=bf)
        add(f"silu_and_mul T={T}", bench(lambda: K.silu_and_mul(gu)), 3 * T * I * 2)
        qkv = torch.randn((T, (HQ + 2 * HKV) * D), device=dev, dtype=bf)
        q, k, v = qkv[:, : HQ * D].view(T, HQ, D), qkv[:, HQ * D : (HQ + HKV) * D].view(T, HKV, D), qkv[:, (HQ + HKV) * D :].view(T, HKV, D)
        pos = torch.arange(T, device=dev)
        cs = torch.randn((40960, D), device=dev)
        nb = (T + BS - 1) // BS + 1
        kc = torch.zeros((nb, BS, HKV, D), device=dev, dtype=bf)
        vc = torch.zeros_like(kc)
        slots = torch.arange(T, device=dev)
        qw = torch.randn(D, device=dev, dtype=bf)
        nbytes = (HQ + 2 * HKV) * T * D * 2 + T * D * 4 + (HQ + HKV) * T * D * 2 + 2 * HKV * T * D * 2
        add(f"qk_norm_rope_store T={T}", bench(lambda: K.qk_norm_rope_store(q, k, v, pos, cs, qw, qw, 1e-6, kc, vc, slots)), nbytes)

    for B, ctx in ((1, 1024), (1, 8192), (64, 1024), (256, 1024)):
        kc, vc, bt = paged(B, ctx)
        q = torch.randn((B, HQ, D), device=dev, dtype=bf)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        nbytes = 2 * B * ctx * HKV * D * 2 + 2 * B * HQ * D * 2
        add(f"decode_attn B={B} ctx={ctx}", bench(lambda: K.paged_attention_decode(q, kc, vc, sl, bt, D**-0.5)), nbytes, 4 * B * HQ * D * ctx)

    for qlen, ctx in ((2048, 2048), (512, 4096)):
        kc, vc, bt = paged(1, ctx)
        q = torch.randn((qlen, HQ, D), device=dev, dtype=bf)
        qsl = torch.tensor([0, qlen], dtype=torch.int32, device=dev)
        sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
        flops = 4 * HQ * D * (qlen * (ctx - qlen) + qlen * (qlen + 1) / 2)
        add(f"prefill_attn q={qlen} ctx={ctx}", bench(lambda: K.paged_attention_prefill(q, kc, vc, qsl, sl, bt, qlen, D**-0.5)), 2 * qlen * HQ * D * 2 + 2 * ctx * HKV * D * 2, flops)

    sampler = CudaSampler(dev)
    sampler.warmup()
    for N in (1, 64, 256):
        logits = torch.randn((N, V), device=dev) * 3
        f = lambda x, dt: torch.full((N,), x, dtype=dt, device=dev)  # noqa: E731
        for name, b in (
            ("greedy", SamplingBatch(f(0.0, torch.float32), f(1.0, torch.float32), f(0, torch.int32), f(0.0, torch.float32), f(1, torch.int64), f(5, torch.int64), True)),
            ("top-p 0.9", SamplingBatch(f(0.8, torch.float32), f(0.9, torch.float32), f(0, torch.int32), f(0.0, torch.float32), f(1, torch.int64), f(5, torch.int64), False)),
        ):
            add(f"sampler {name} N={N}", bench(lambda: sampler.sample(logits, b)), N * V * 4)
            if not b.all_greedy:
                add(f"cut_thresholds {name} N={N}", bench(lambda: cut_thresholds(logits, b)), N * V * 4)
        t = f(1.0, torch.float32)
        s64 = f(3, torch.int64)
        lo = logits.min(dim=1).values
        hi = logits.max(dim=1).values
        z = f(0.0, torch.float32)
        add(f"numba sample_partials (all kept) N={N}", bench(lambda: numba_kernels.sample_partials(logits, t, lo, hi, z, s64, s64, False)), N * V * 4)
        add(f"numba sample_partials greedy N={N}", bench(lambda: numba_kernels.sample_partials(logits, t, lo, hi, z, s64, s64, True)), N * V * 4)
        add(f"torch.sort [N,V] N={N}", bench(lambda: torch.sort(logits, dim=-1, descending=True)), N * V * 4)

    w = torch.randn((V, H), device=dev, dtype=bf)
    for T in (1, 64):
        x = torch.randn((T, H), device=dev, dtype=bf)
        add(f"linear lm_head T={T}", bench(lambda: torch.nn.functional.linear(x, w)), V * H * 2 + T * (H + V) * 2, 2 * T * H * V)

    if args.sweep:
        sweep(add)

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'kernel':58s} {'eager_us':>9s} {'graph_us':>9s} {'floor_us':>9s} {'GB/s':>8s} {'TFLOP/s':>8s}")
    for r in rows:
        print(f"{r['kernel']:58s} {r['eager_us']:9.2f} {r['graph_us']:9.2f} {r['floor_us']:9.2f} {r['gbps']:8.1f} {r['tflops']:8.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def sweep(add) -> None:
    from infer_backend_cuda.kernels import attention_decode, attention_prefill

    orig_p, orig_d = attention_prefill._prefill_config, attention_decode._decode_config
    try:
        for qlen, ctx in ((2048, 2048), (512, 4096)):
            kc, vc, bt = paged(1, ctx)
            q = torch.randn((qlen, HQ, D), device=dev, dtype=bf)
            qsl = torch.tensor([0, qlen], dtype=torch.int32, device=dev)
            sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
            flops = 4 * HQ * D * (qlen * (ctx - qlen) + qlen * (qlen + 1) / 2)
            for cfg in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 8, 3), (64, 32, 4, 2), (128, 128, 8, 2), (64, 128, 4, 2)):
                attention_prefill._prefill_config = lambda d, e, cfg=cfg: cfg
                try:
                    t = bench(lambda: K.paged_attention_prefill(q, kc, vc, qsl, sl, bt, qlen, D**-0.5), calls=3, reps=5)
                except Exception as e:  # out of resources etc.
                    print("prefill", cfg, "failed:", type(e).__name__, str(e)[:100])
                    continue
                add(f"sweep prefill q={qlen} ctx={ctx} cfg={cfg}", t, 2 * qlen * HQ * D * 2 + 2 * ctx * HKV * D * 2, flops)
        attention_prefill._prefill_config = orig_p
        for B, ctx in ((1, 8192), (64, 1024), (256, 1024), (32, 4096)):
            kc, vc, bt = paged(B, ctx)
            q = torch.randn((B, HQ, D), device=dev, dtype=bf)
            sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            nbytes = 2 * B * ctx * HKV * D * 2 + 2 * B * HQ * D * 2
            for cfg in ((64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 8, 2), (64, 4, 3), (128, 8, 3), (16, 4, 2)):
                attention_decode._decode_config = lambda d, n, cfg=cfg: cfg
                for splits in (None, 4, 8, 16, 32):
                    try:
                        t = bench(lambda: K.paged_attention_decode(q, kc, vc, sl, bt, D**-0.5, num_splits=splits), calls=5, reps=5)
                    except Exception as e:
                        print("decode", cfg, "failed:", type(e).__name__, str(e)[:100])
                        continue
                    add(f"sweep decode B={B} ctx={ctx} cfg={cfg} S={splits}", t, nbytes, 4 * B * HQ * D * ctx)
    finally:
        attention_prefill._prefill_config, attention_decode._decode_config = orig_p, orig_d


if __name__ == "__main__":
    main()
