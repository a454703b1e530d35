"""Tune and time the mid GEMM (2-128 rows) against cuBLAS at one model's decode shapes, BF16, and on block-FP8
weights (1-128 rows) against the FP8 path it would replace. At 2-8 rows only the BF16 shapes this GPU's skinny-GEMM
table leaves to cuBLAS are tuned (the skinny GEMM is asked first there).

Ops: `linear` against `F.linear`; `linear_silu_mul` (the gate / up weight, SiLU-and-mul in the epilogue) against
`F.linear` then the SiLU-and-mul kernel, as the adapter runs it otherwise; `fp8_linear` / `fp8_linear_silu_mul`
(128x128 weight blocks, groups of 128) against `fp8_gemm.fp8_block_linear` on its own rules and table (cuBLASLt from
65 rows on Hopper), then the SiLU-and-mul kernel for the gated op; both sides quantize the activations first.

Run on the GPU machine:  PYTHONPATH=packages/infer-core/src:packages/infer-backend-cuda/src \
    python3 packages/infer-backend-cuda/scripts/bench_mid_gemm.py --table configs.json --json out.json
Each (row bucket, N, K) is timed as CUDA-graph replays of calls that cycle through enough weight copies (>= 256 MB)
that no call finds its weight in the 50 MB L2, as in a decode step. `--table` writes each shape's best config in the
format `kernels/mid_gemm.py` reads, `use` saying whether it beat cuBLAS, merged with the file's other entries.
`--budget-s` bounds the tuning (candidates are tried most promising first; what was left is reported)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_skinny_gemm import MODEL_SHAPES
from graph_timing import copy_bandwidth, tune_against
from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels import fp8_gemm as F8, mid_gemm as G, skinny_gemm as S, split_k, tuned_table

# (block_n, block_k, warps, stages): 64 or 128 weight rows fill one or two warpgroups' wgmma M side; the K step
# and the stage count set the bytes in flight per SM (a 128 x 128 x 128-row stage is 64 KB of shared memory). On the
# H100 only 64-row tiles won (nineteenth session); 32 rows (mma.sync, twice the programs) are tried for the narrow
# o_proj / down outputs, where cuBLAS still won at 64-128 rows.
# FP8 steps K a scale group (128) at a time: the 128-deep tiles, and deeper pipelines (a 64-row stage is 8 KB).
FP8_TILES = [(64, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 6), (64, 128, 4, 8), (128, 128, 8, 3), (128, 128, 8, 4),
             (128, 128, 4, 4), (32, 128, 4, 4), (32, 128, 4, 6)]
TILES = [(64, 128, 4, 4), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 64, 4, 6), (128, 64, 8, 4),
         (128, 128, 8, 3), (128, 64, 8, 3), (32, 128, 4, 4), (32, 64, 4, 4), (128, 64, 4, 4), (64, 128, 4, 6)]
SMS = 132
FP8_GROUP = 128


def candidates(op: str, n: int, k: int) -> list[G.MidConfig]:
    """Each tile with the K splits that bring the launch to about one to four programs an SM."""
    out = []
    gated = op.endswith("linear_silu_mul")
    for bn, bk, warps, stages in FP8_TILES if op in G.FP8_OPS else TILES:
        tiles = -(-n // (bn // 2 if gated else bn))
        splits = [1] if gated else sorted(
            {s for s in (1, 2, 3, 4, 6, 8) if tiles * s <= 4 * SMS and k // (bk * s) >= 4})
        out += [G.MidConfig(bn, bk, warps, stages, s) for s in splits or [1]]
    return out


class Case:
    def __init__(self, op: str, m: int, n: int, k: int, copies: int, dev: torch.device) -> None:
        bf = torch.bfloat16
        self.op = op
        self.ws = [torch.randn((n, k), device=dev, dtype=bf) * 0.02 for _ in range(copies)]
        self.x = torch.randn((m, k), device=dev, dtype=bf)
        self.out = torch.empty((m, n // 2 if op == "linear_silu_mul" else n), device=dev, dtype=bf)
        self.full = torch.empty((m, n), device=dev, dtype=bf)

    def mid(self, i: int, cfg: G.MidConfig) -> torch.Tensor:
        if self.op == "linear_silu_mul":
            return G.mid_linear_silu_mul(self.x, self.ws[i], out=self.out, config=cfg)
        return G.mid_linear(self.x, self.ws[i], out=self.out, config=cfg)

    def baseline(self, i: int) -> torch.Tensor:
        if self.op == "linear_silu_mul":
            return K.silu_and_mul(torch.matmul(self.x, self.ws[i].T, out=self.full), out=self.out)
        return torch.matmul(self.x, self.ws[i].T, out=self.out)


class Fp8Case:
    """Block-FP8 weights (random e4m3 codes, 128x128 scale blocks); both sides start from the bf16 activations."""

    def __init__(self, op: str, m: int, n: int, k: int, copies: int, dev: torch.device) -> None:
        self.gated = op == "fp8_linear_silu_mul"
        self.ws = [(torch.randn((n, k), device=dev) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
                   for _ in range(copies)]
        self.scale_inv = torch.rand((-(-n // FP8_GROUP), -(-k // FP8_GROUP)), device=dev) * 1e-3 + 1e-4
        self.scale_row = (torch.arange(n, device=dev) // FP8_GROUP).to(torch.int32)
        self.x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)

    def _operands(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x, self.ws[i], self.scale_inv, self.scale_row

    def mid(self, i: int, cfg: G.MidConfig) -> torch.Tensor:
        if self.gated:
            return F8.fp8_block_linear_silu_mul(*self._operands(i), FP8_GROUP, config=cfg)
        return F8.fp8_block_linear(*self._operands(i), FP8_GROUP, config=cfg)

    def baseline(self, i: int) -> torch.Tensor:  # the mid table is switched off while tuning (main)
        if self.gated:
            return F8.fp8_block_linear_silu_mul(*self._operands(i), FP8_GROUP)
        return F8.fp8_block_linear(*self._operands(i), FP8_GROUP)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODEL_SHAPES), default="qwen3-4b")
    ap.add_argument("--ops", default="linear,linear_silu_mul")
    ap.add_argument("--ms", default="64,128,32,16,2,4,8")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--table", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    split_k.allocate_counters(dev)
    name = torch.cuda.get_device_name(dev)
    t_start = time.perf_counter()
    shapes = MODEL_SHAPES[args.model]
    G.ENABLED = False  # the baselines run what the adapter runs without the mid table (the candidates name configs)
    work = [(op, m, shape) for m in (int(v) for v in args.ms.split(",")) for op in args.ops.split(",")
            for shape in (("gate_up",) if op.endswith("linear_silu_mul") else ("qkv", "o_proj", "gate_up", "down"))
            if shape in shapes and (op in G.FP8_OPS or m > S.MAX_M
                                    or S.choose_config("linear", m, *shapes[shape], dev) is None)]
    rows, entries = [], []
    for i, (op, m, shape) in enumerate(work):
        deadline = t_start + args.budget_s * (i + 1) / len(work)  # a case's share, what earlier ones left included
        n, k = shapes[shape]
        nbytes = n * k * (1 if op in G.FP8_OPS else 2)
        case = (Fp8Case if op in G.FP8_OPS else Case)(op, m, n, k, max(2, -(-256 * 2**20 // nbytes)), dev)
        configs = candidates(op, n, k)
        t = tune_against(case.baseline, case.mid, configs, len(case.ws), 0.02,
                         lambda timed: timed > 0 and time.perf_counter() > deadline)
        row = dict(op=op, m=m, shape=shape, n=n, k=k, baseline_us=round(t.baseline_us, 2), mid_us=round(t.best_us, 2),
                   floor_us=round(nbytes / copy_bandwidth() * 1e6, 2), baseline_tbps=round(nbytes / t.baseline_us / 1e6, 2),
                   mid_tbps=round(nbytes / t.best_us / 1e6, 2), configs_tried=t.tried, configs=len(configs),
                   best=t.best._asdict() if t.best else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if (entry := t.table_entry(op=op, m=m, n=n, k=k)) is not None:
            entries.append(entry)
        del case
        torch.cuda.empty_cache()
    print(f"\n{'op':>19} {'m':>3} {'shape':>8} {'floor':>7} {'before':>7} {'mid':>7} (us)  tried  best")
    for r in rows:
        print(f"{r['op']:>19} {r['m']:>3} {r['shape']:>8} {r['floor_us']:>7.2f} {r['baseline_us']:>7.2f} "
              f"{r['mid_us']:>7.2f}  {r['configs_tried']:>2}/{r['configs']:<2}  "
              f"{tuple(r['best'].values()) if r['best'] else None}")
    print(f"tuning took {time.perf_counter() - t_start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(dict(device=name, torch=torch.__version__, rows=rows), indent=2))
    if args.table:
        tuned_table.merge(args.table, name, entries, G.table_key)


if __name__ == "__main__":
    main()
