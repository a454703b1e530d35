"""Time launch configs of the quantized GEMMs (AWQ W4A16, block-FP8 W8A8) at Qwen3-4B's decode shapes.

Run on the GPU machine (one command, a table at the end):
    PYTHONPATH=packages/infer-core/src:packages/infer-backend-cuda/src \
    python3 packages/infer-backend-cuda/scripts/bench_quant_gemm.py [--ms 1,8,32] [--formats awq,fp8] [--json out.json]

Per (format, M, shape): the default config (`default_config` of the kernel's module), a small grid around it,
and the best; each timed as CUDA-graph replays over enough weight copies (>= 256 MB) that no call finds its
weight in L2, with the byte floor (weight + scale bytes / copy bandwidth) and cuBLAS BF16 at the same shape for
scale. A config whose result differs from the default's is reported and skipped. Every case times its default
first (one line each as it finishes); then the cases take turns at their alternatives, likeliest first, until
`--budget-s` (each config is a Triton compile, ~1-3 s); `tried` says how many configs a case timed. A short run:
    ... bench_quant_gemm.py --budget-s 40 --formats awq --ms 1,8"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path

import torch

from bench_skinny_gemm import MODEL_SHAPES
from graph_timing import copy_bandwidth, graph_replay_us
from infer_backend_cuda.kernels import awq_gemm as A, fp8_gemm as F8, split_k, tuned_table

DECODE_SHAPES = ("qkv", "o_proj", "gate_up", "down")
SHAPES = MODEL_SHAPES["qwen3-4b"]
GROUP = 128


def _splits(default: int) -> list[int]:
    return sorted({1, max(1, default // 2), default, 2 * default})


def awq_candidates(m: int, n: int, k: int) -> list[A.AwqConfig]:
    """The default first, then alternatives, the likeliest first (a short run times only the head): the GEMV's
    column block, K step and half its splits, and the 16-row tensor-core tile (also 256 columns wide)."""
    d = A.choose_config(m, n, k, GROUP, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if m > A.SKINNY_MAX_M:
        # also 4x the default's K ranges: its workspace rule (`awq_gemm.default_config`) holds them to a quarter
        grid = [A.AwqConfig(bm, bn, bk, w, 3, s) for bm, bn, bk, w in itertools.product(
            (32, 64), (64, 128), (64, 128), (4, 8)) for s in _splits(d.k_splits) + [4 * d.k_splits]]
        return [d] + [c for c in grid if c != d]
    gemv_splits = A.gemv_config(m, n, k, GROUP).k_splits
    gemv = [A.AwqConfig(A.next_pow2(m), bn, bk, w, 1, s) for w in (4, 8) for bn in (256, 512)
            for bk in ((8, 16) if m == 1 else (4, 8)) for s in (gemv_splits, max(1, gemv_splits // 2))]
    if m == 1:  # narrower column blocks (more programs, fewer registers), finer K ranges, the old wide default
        gemv = [A.AwqConfig(1, bn, bk, w, 1, s) for bn, bk, w in ((128, 8, 1), (64, 8, 1), (128, 16, 2), (128, 8, 4),
                                                                 (256, 16, 4), (256, 8, 4), (512, 8, 4))
                for s in (gemv_splits, 2 * gemv_splits, max(1, gemv_splits // 2))] + gemv
    tiled_splits = min(split_k.num_splits(k // 64, -(-n // 128)), max(1, k // (64 * m)))
    tiled = [A.AwqConfig(16, bn, 64, w, 3, s) for bn, w in ((128, 4), (256, 4), (128, 8), (256, 8))
             for s in (tiled_splits, max(1, tiled_splits // 2))]
    if m > 1:  # decode rows in the tiled kernel: whole 128-byte word rows (256 columns), whole-group K steps
        # (both ~6.5 SASS instructions a weight against 8.6 at 128 x 64: sass_census.py), narrower tiles, more K ranges
        splits = d.k_splits if d.block_m > A.SKINNY_MAX_M else tiled_splits
        tiled = [A.AwqConfig(16, bn, bk, w, st, s) for bn, bk, w, st in (
            (256, 64, 4, 3), (128, 128, 4, 3), (256, 128, 8, 3), (256, 64, 8, 3), (128, 64, 4, 2), (256, 64, 4, 2),
            (64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 2, 3), (128, 64, 2, 3))
                 for s in (splits, 2 * splits, max(1, splits // 2))] + tiled
    if m == 1:  # the decode tiles at one row: those tuned at 2-16 rows first (o_proj's beat the GEMV at 2 rows)
        tuned = A._tuned_table(torch.cuda.get_device_name()).get((A.DECODE_TILE_M, n, k, GROUP)) \
            if torch.cuda.is_available() else None
        tiled = ([tuned] if tuned else []) + tiled[:6]
    first, second = (gemv, tiled) if m <= A.GEMV_MAX_M else (tiled, gemv)
    # The two kernels in turn, so that a short run has timed both.
    grid = [c for pair in itertools.zip_longest(first, second) for c in pair if c is not None]
    return list(dict.fromkeys([d] + grid))


def fp8_candidates(m: int, n: int, k: int) -> list[F8.Fp8Config]:
    d = F8.default_config(m, n, k, GROUP)
    if m <= F8.SKINNY_MAX_M:
        bm = F8.next_pow2(m)  # the CUDA cores, quantizing x in the GEMM
        grid = [F8.Fp8Config(bm, bn, w, st, s) for bn, w, st in itertools.product(
            (8, 16, 32, 64) if m == 1 else (4, 8, 16, 32), (2, 4), (1, 2)) if bm * bn <= 64
            for s in (1, 4, 12)]
        if m <= 2:  # whole weight rows streamed, as the BF16 skinny GEMM does (Triton pipelines none of its loads:
            # one stage; one warp puts every thread of a 4-group step along K, which one row's accumulator wants)
            grid += [F8.Fp8Config(m, bn, w, 1, 1, g) for bn, g, w in itertools.product(
                (2, 4, 8), (2, 4, 8), (1, 2, 4)) if bn * g <= 32]
        # the tensor cores, after the quantization kernel
        grid += [F8.Fp8Config(16, bn, 4, st, s) for bn, st in itertools.product((32, 64, 128), (2, 3))
                 for s in _splits(d.k_splits)]
    elif m <= 64:  # tiles of 64 columns first (the ninth session's bests), deeper pipelines, then the rest
        grid = [F8.Fp8Config(bm, bn, w, st, s) for bn, st, bm, w in (
            (64, 3, 64, 4), (64, 4, 64, 4), (64, 5, 64, 4), (64, 4, 32, 4), (128, 4, 64, 4), (64, 4, 16, 4),
            (128, 3, 64, 8), (32, 4, 64, 4), (128, 3, 32, 4))
            for s in _splits(d.k_splits) + [2 * d.k_splits + 2]]
    else:  # the likeliest first: a short budget (--ms 128,256,2048 in ~40 s) times the head of each list
        return _fp8_wide_candidates(m, n, k, d)
    return [d] + [c for c in grid if c != d]


@functools.cache
def _scaled_mm_here() -> bool:
    ok = F8.scaled_mm_available(torch.device("cuda"))
    print(f"FP8 from {F8.SCALED_MM_MIN_M} rows: cuBLASLt block-scaled GEMM (torch {torch.__version__}) "
          f"{'available, the default (config scaled_mm=True)' if ok else 'unavailable: Triton tiles'}", flush=True)
    return ok


def _fp8_wide_candidates(m: int, n: int, k: int, d: F8.Fp8Config) -> list[F8.Fp8Config]:
    """65+ rows: what runs by default first (cuBLASLt's block-scaled GEMM where the device has it, else the Triton
    default), then the Triton default, the 128x128 tiles used before (split only at K >= 32 M), the default with
    half / twice its splits and the other column tile, 64 x 64 tiles with deeper pipelines (the H200's bests at
    64-128 rows) and one-row-tile candidates."""
    tiles = -(-m // 128) * -(-n // 128)
    before = F8.Fp8Config(128, 128, 8, 3, min(F8.split_k.num_splits(k // GROUP, tiles), max(1, k // (32 * m))))
    scaled = F8.Fp8Config(0, 0, 0, 0, scaled_mm=True)
    first = [scaled, d] if _scaled_mm_here() and m >= F8.SCALED_MM_MIN_M else [d]
    others = [before, d._replace(k_splits=max(1, d.k_splits // 2)), d._replace(k_splits=2 * d.k_splits),
              d._replace(block_n=64 if d.block_n == 128 else 128, num_warps=4, num_stages=4)] + [
        F8.Fp8Config(64, 64, 4, st, s) for st in (4, 5) for s in _splits(d.k_splits)] + [
        # one row tile at 128 rows: the weight read once (64-row tiles read it twice)
        F8.Fp8Config(128, bn, w, st, s) for bn, w, st in ((64, 8, 3), (64, 8, 4), (32, 4, 4), (64, 4, 3))
        for s in _splits(d.k_splits)]
    return first + [c for i, c in enumerate(others) if c not in first and c not in others[:i]]


class Case:
    """One format at one shape: weight copies (random codes, small scales) and the call with a config."""

    def __init__(self, fmt: str, m: int, n: int, k: int, dev: torch.device) -> None:
        self.fmt = fmt
        g = k // GROUP
        if fmt == "awq":
            self.nbytes = n * k // 2 + g * n * 2 + g * n // 2
            copies = max(2, -(-256 * 2**20 // self.nbytes))
            rand = lambda *s: torch.randint(-2**31, 2**31 - 1, s, dtype=torch.int32, device=dev)  # noqa: E731
            self.ws = [(rand(k, n // 8), rand(g, n // 8),
                        (torch.rand((g, n), device=dev) * 0.01 + 1e-3).half()) for _ in range(copies)]
        else:
            self.nbytes = n * k + (-(-n // GROUP)) * g * 4
            copies = max(2, -(-256 * 2**20 // self.nbytes))
            rows = (torch.arange(n, device=dev, dtype=torch.int32) // GROUP)
            self.ws = [((torch.randn((n, k), device=dev) * 0.5).to(torch.float8_e4m3fn),
                        torch.rand((-(-n // GROUP), g), device=dev) * 0.01 + 1e-3, rows) for _ in range(copies)]
        self.x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
        self.out = torch.empty((m, n), device=dev, dtype=torch.bfloat16)
        self.dense = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02

    def run(self, i: int, cfg) -> torch.Tensor:  # noqa: ANN001 - either config type
        if self.fmt == "awq":
            return A.awq_linear(self.x, *self.ws[i], out=self.out, config=cfg)
        return F8.fp8_block_linear(self.x, *self.ws[i], GROUP, out=self.out, config=cfg)


class Tuning:
    """One case's state: its weights, its candidates still to time, what it has timed."""

    def __init__(self, fmt: str, m: int, shape: str, dev: torch.device) -> None:
        self.fmt, self.m, self.shape = fmt, m, shape
        n, k = SHAPES[shape]
        self.case = Case(fmt, m, n, k, dev)
        self.copies = len(self.case.ws)
        self.cublas = graph_replay_us(lambda i: torch.matmul(self.case.x, self.case.dense.T, out=self.case.out),
                                      self.copies)
        self.todo = awq_candidates(m, n, k) if fmt == "awq" else fp8_candidates(m, n, k)
        self.default = self.todo[0]
        self.ref = self.case.run(0, self.default).float()
        self.timed: list[tuple[float, object]] = []

    def time_next(self) -> None:
        cfg = self.todo.pop(0)
        try:
            err = (self.case.run(0, cfg).float() - self.ref).abs().max().item()
            if err > 1e-2 * self.ref.abs().max().item() + 1e-3:
                raise RuntimeError(f"result differs from the default config's (max err {err:.3g})")
            self.timed.append((graph_replay_us(lambda i: self.case.run(i, cfg), self.copies, reps=15), cfg))
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile / launch is skipped
            print(f"  skip {self.fmt} m={self.m} {self.shape} {cfg}: {type(exc).__name__}: {str(exc)[:120]}",
                  flush=True)

    def row(self) -> dict:
        n, k = SHAPES[self.shape]
        best_us, best = min(self.timed, key=lambda t: t[0]) if self.timed else (float("nan"), None)
        default_us = next((us for us, cfg in self.timed if cfg == self.default), float("nan"))
        return dict(fmt=self.fmt, m=self.m, shape=self.shape, n=n, k=k,
                    floor_us=round(self.case.nbytes / copy_bandwidth() * 1e6, 2), default_us=round(default_us, 2),
                    best_us=round(best_us, 2), cublas_bf16_us=round(self.cublas, 2), tried=len(self.timed),
                    default=tuple(self.default), best=tuple(best) if best else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="awq,fp8")
    ap.add_argument("--ms", default="1,8,32")
    ap.add_argument("--shapes", default=",".join(DECODE_SHAPES))
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--table", type=Path, help="write the bests into this table (awq_gemm's or fp8_gemm's _TABLE "
                                               "format; with one of --formats)")
    args = ap.parse_args()
    if args.table and args.formats not in ("awq", "fp8"):
        ap.error("--table takes one format: --formats awq or --formats fp8")
    dev = torch.device("cuda")
    t_start = time.perf_counter()
    # Pass one: every case's default config (each config is a Triton compile, so a short budget would otherwise
    # end inside the first cases' grids); its line is printed as it finishes.
    tunings = []
    for fmt in args.formats.split(","):
        for m in map(int, args.ms.split(",")):
            for shape in args.shapes.split(","):
                t = Tuning(fmt, m, shape, dev)
                t.time_next()
                tunings.append(t)
                print(json.dumps(t.row()), flush=True)
    # Then the alternatives, one per case in turn, the likeliest first, while the budget lasts.
    while time.perf_counter() - t_start < args.budget_s and any(t.todo for t in tunings):
        for t in tunings:
            if t.todo and time.perf_counter() - t_start < args.budget_s:
                t.time_next()
    rows = [t.row() for t in tunings]
    print(f"\n{'fmt':>4} {'m':>3} {'shape':>8} {'floor':>7} {'default':>8} {'best':>7} {'bf16':>7} (us) tried  "
          f"best config ({time.perf_counter() - t_start:.0f} s)")
    for r in rows:
        print(f"{r['fmt']:>4} {r['m']:>3} {r['shape']:>8} {r['floor_us']:>7.2f} {r['default_us']:>8.2f} "
              f"{r['best_us']:>7.2f} {r['cublas_bf16_us']:>7.2f} {r['tried']:>5}  {r['best']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev), rows=rows), indent=2))
    if args.table:
        write_table(args.table, args.formats, torch.cuda.get_device_name(dev), rows)


def write_table(path: Path, fmt: str, device: str, rows: list[dict]) -> None:
    """Each row bucket's best (the kernel module's `table_rows`; of the bucket's fewest rows timed: what a decode
    step at low load runs) into the table its `choose_config` reads, replacing this device's entries of those keys."""
    module = A if fmt == "awq" else F8
    best: dict[tuple, dict] = {}
    for r in sorted((r for r in rows if r["fmt"] == fmt and r["best"]), key=lambda r: r["m"], reverse=True):
        bucket = module.table_rows(r["m"])
        if bucket:
            entry = dict(m=bucket, n=r["n"], k=r["k"], group=GROUP, config=list(r["best"]), us=r["best_us"])
            best[module.table_key(entry)] = entry
    tuned_table.merge(path, device, list(best.values()), module.table_key)


if __name__ == "__main__":
    main()
