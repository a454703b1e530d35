"""Tune and time the skinny GEMM against cuBLAS (`F.linear`) at decode row counts, Qwen3-4B shapes, BF16.

Run on the GPU machine:  PYTHONPATH=packages/infer-core/src:packages/infer-backend-cuda/src \
    python3 packages/infer-backend-cuda/scripts/bench_skinny_gemm.py --table configs.json --json out.json
Each (M bucket, N, K) is timed as CUDA-graph replays of calls that cycle through enough copies of the weight
(>= 256 MB in all) that no call finds its weight in the 50 MB L2, as in a real decode step. `--table` writes
the winning launch configuration of every shape in the format `kernels/skinny_gemm.py` reads
(`{device name: [entry, ...]}`; `use` says whether the kernel beat cuBLAS there), merging with the file's
other devices. `--budget-s` bounds the tuning time (shapes left untuned are reported)."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from infer_backend_cuda.kernels import skinny_gemm as S

SHAPES = {  # Qwen3-4B: (N, K) of qkv, o, gate_up, down, lm_head
    "qkv": (6144, 2560),
    "o_proj": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
    "lm_head": (151936, 2560),
}
BW = 4.27e12  # measured D2D copy bandwidth (read + write), shared/DEVICE.md


def graph_us(fn_for_copy, copies: int, reps: int = 15) -> float:
    """GPU microseconds per call: a graph of `copies` calls (one per weight copy), median of replays."""
    for i in range(copies):
        fn_for_copy(i)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn_for_copy(0)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn_for_copy(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    return statistics.median(times)


def candidates(m: int) -> list[S.SkinnyConfig]:
    grid = itertools.product((2, 4, 8, 16), (128, 256, 512, 1024), (2, 4, 8), (1, 2, 3))
    out = [S.SkinnyConfig(bn, bk, w, s) for bn, bk, w, s in grid if m * bn * bk <= (16384 if m == 1 else 8192)]
    if m > 1:  # smaller grid: the M = 1 sweep shows which corner matters
        out = [c for c in out if c.num_stages != 2 and c.block_n <= 8]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--table", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    t_start = time.perf_counter()
    rows, entries = [], []
    for m in (int(v) for v in args.ms.split(",")):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            nbytes = n * k * 2
            copies = max(2, -(-256 * 2**20 // nbytes))
            ws = [torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
            outs = torch.empty((m, n), device=dev, dtype=torch.bfloat16)
            cublas = graph_us(lambda i: torch.matmul(x, ws[i].T, out=outs), copies)
            ref = F.linear(x.float(), ws[0].float())
            best, best_us, tried = None, float("inf"), 0
            for cfg in candidates(m):
                if time.perf_counter() - t_start > args.budget_s:
                    break
                try:
                    y = S.skinny_linear(x, ws[0], config=cfg)
                    err = (y.float() - ref).abs().max().item()
                    if err > 0.05 * ref.abs().max().item() + 1e-2:
                        raise RuntimeError(f"wrong result (max err {err})")
                    us = graph_us(lambda i: S.skinny_linear(x, ws[i], out=outs, config=cfg), copies)
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile / launch is skipped
                    print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                tried += 1
                if us < best_us:
                    best, best_us = cfg, us
            floor = nbytes / BW * 1e6
            row = dict(m=m, shape=shape, n=n, k=k, cublas_us=round(cublas, 2), skinny_us=round(best_us, 2),
                       floor_us=round(floor, 2), cublas_tbps=round(nbytes / cublas / 1e6, 2),
                       skinny_tbps=round(nbytes / best_us / 1e6, 2), configs_tried=tried,
                       best=best._asdict() if best else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if best is not None:
                entries.append(dict(m=m, n=n, k=k, use=best_us < cublas, **best._asdict()))
            del ws
            torch.cuda.empty_cache()
    print(f"\n{'m':>2} {'shape':>8} {'floor':>7} {'cublas':>7} {'skinny':>7} (us)  best")
    for r in rows:
        print(f"{r['m']:>2} {r['shape']:>8} {r['floor_us']:>7.2f} {r['cublas_us']:>7.2f} {r['skinny_us']:>7.2f}  {r['best']}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=name, torch=torch.__version__, rows=rows), indent=2))
    if args.table:
        table = json.loads(args.table.read_text()) if args.table.exists() else {}
        table[name] = entries
        args.table.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
