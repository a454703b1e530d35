"""Tune and time the skinny GEMMs against their cuBLAS paths at decode row counts, BF16, at one model's shapes
(`--model`: Qwen3-4B by default, or Qwen3.5-4B, whose hybrid layers add the GDN input projection).

Ops: `linear` against `F.linear`; `add_rms_norm_linear` (qkv, gate_up) against the unfused path the adapter would
otherwise take (the norm kernel, then `CudaMathOps.linear`). The gate / up GEMM's SiLU-and-mul epilogue takes the
`linear` configs, so that shape's `linear` entry is timed in that form (`gated_case`).

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
import time
from pathlib import Path

import torch

from graph_timing import copy_bandwidth, tune_against
from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels import skinny_gemm as S, tuned_table
from infer_backend_cuda.ops import CudaMathOps

MODEL_SHAPES = {  # (N, K) of each decode linear
    "qwen3-4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
                 "lm_head": (151936, 2560)},
    # Qwen3.5-4B: the GDN in_proj fuses qkv (8192) | z (4096) | b (32) | a (32); the attention's q is doubled
    # (query | gate: 8192) next to k and v (1024 each); o_proj and out_proj are Qwen3-4B's o_proj shape.
    "qwen3.5-4b": {"in_proj": (12352, 2560), "qkv": (10240, 2560), "o_proj": (2560, 4096), "gate_up": (18432, 2560),
                   "down": (2560, 9216), "lm_head": (248320, 2560)},
}
NORMED = ("in_proj", "qkv", "gate_up")  # the linears after a residual add + RMSNorm
GATE_UP = "gate_up"  # the gated MLP's [gate | up] GEMM: its SiLU-and-mul epilogue takes the `linear` entries


def gated_case(op: str, shape: str) -> bool:
    """Whether the `linear` entry of this shape is timed as the model runs it: the gate / up GEMM with its SiLU-and-mul
    epilogue (against cuBLAS and the SiLU kernel) while `INFER_CUDA_GATED_GEMM` is on."""
    return op == "linear" and shape == GATE_UP and S.GATED


def op_shapes(shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[str, ...]]:
    """Which shapes each op serves in a decode layer."""
    return {"linear": tuple(shapes), "add_rms_norm_linear": tuple(s for s in NORMED if s in shapes)}


def dot_candidates() -> list[S.SkinnyConfig]:
    grid = itertools.product((16, 32, 64), (64, 128, 256, 512), (4, 8), (1, 3))
    return [S.SkinnyConfig(bn, bk, w, s, use_dot=True) for bn, bk, w, s in grid if bn * bk <= 16384]


def prefetch_candidates(tuned: S.SkinnyConfig | None) -> list[S.SkinnyConfig]:
    winners = [S.SkinnyConfig(4, 512, 2, 1), S.SkinnyConfig(4, 1024, 4, 3), S.SkinnyConfig(4, 256, 2, 1),
               S.SkinnyConfig(2, 1024, 2, 3), S.SkinnyConfig(64, 256, 4, 3, True), S.SkinnyConfig(32, 128, 4, 3, True),
               S.SkinnyConfig(64, 128, 4, 3, True)]
    out = [tuned, tuned._replace(prefetch=True)] if tuned else []
    for c in winners:
        for stages in (1, 2):
            out.append(c._replace(prefetch=True, num_stages=stages))
    return out


def rowwise_candidates(m: int) -> list[S.SkinnyConfig]:
    """CUDA-core tiles that `rowwise_fits` in bf16 (every thread along K), for 1-2 rows, with and without the weight
    prefetch (Triton does not pipeline these loads: without it each K step waits for its own tile)."""
    tiles = [S.SkinnyConfig(bn, bk, w, 1, prefetch=pf, rowwise=True)
             for bn, (bk, w), pf in itertools.product((2, 4, 8), ((512, 2), (1024, 2), (1024, 4)), (False, True))]
    return [c for c in tiles if S.rowwise_fits(c, 2) and m * c.block_n * c.block_k <= (16384 if m == 1 else 8192)]


def candidates(op: str, m: int) -> list[S.SkinnyConfig]:
    grid = itertools.product((2, 4, 8, 16), (128, 256, 512, 1024), (2, 4, 8), (1, 2, 3))
    out = [S.SkinnyConfig(bn, bk, w, s) for bn, bk, w, s in grid if m * bn * bk <= (16384 if m == 1 else 8192)]
    if m > 1 or op != "linear":  # smaller grid: the plain M = 1 sweep showed which corner matters
        out = [c for c in out if c.num_stages != 2 and c.block_n <= 8 and c.num_warps <= 4 and c.block_k >= 128]
    return out


def weight_copies(n: int, k: int) -> int:
    """Copies of a bf16 `[n, k]` weight that a timed graph cycles through: >= 256 MB, so none is L2-resident."""
    return max(2, -(-256 * 2**20 // (n * k * 2)))


class Case:
    """One op at one shape: the weight copies, its inputs, the skinny call and the path it replaces."""

    def __init__(self, op: str, m: int, n: int, k: int, copies: int, dev: torch.device, gated: bool = False) -> None:
        bf = torch.bfloat16
        self.ws = [torch.randn((n, k), device=dev, dtype=bf) * 0.02 for _ in range(copies)]
        self.op, self.gated = op, gated
        self.out = torch.empty((m, n // 2 if gated else n), device=dev, dtype=bf)
        self.x = torch.randn((m, k), device=dev, dtype=bf)
        self.r = torch.randn((m, k), device=dev, dtype=bf)
        self.r_out = torch.empty_like(self.r)
        self.nw = torch.randn((k,), device=dev, dtype=bf) * 0.1 + 1
        self.math = CudaMathOps()

    def skinny(self, i: int, cfg: S.SkinnyConfig) -> torch.Tensor:
        if self.gated:
            return S.skinny_linear_silu_mul(self.x, self.ws[i], out=self.out, config=cfg)
        if self.op == "add_rms_norm_linear":
            return S.skinny_add_rms_norm_linear(self.x, self.r, self.nw, 1e-6, self.ws[i], out=self.out,
                                                residual_out=self.r_out, config=cfg)[0]
        return S.skinny_linear(self.x, self.ws[i], out=self.out, config=cfg)

    def baseline(self, i: int) -> torch.Tensor:
        if self.gated:
            return K.silu_and_mul(torch.matmul(self.x, self.ws[i].T))
        if self.op == "add_rms_norm_linear":
            normed, _ = K.add_rms_norm(self.x, self.r, self.nw, 1e-6)
            return self.math.linear(normed, self.ws[i])
        return torch.matmul(self.x, self.ws[i].T, out=self.out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODEL_SHAPES), default="qwen3-4b")
    ap.add_argument("--ops", default="linear,add_rms_norm_linear")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--shapes", default="", help="a subset of each op's shapes (default: all of the model's)")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--dot", action="store_true",
                    help="try only tensor-core configs, plus the shape's current table entry (so never worse)")
    ap.add_argument("--prefetch", action="store_true",
                    help="try the shape's current table entry with and without weight prefetch, and prefetching "
                         "variants of the tile shapes that won elsewhere")
    ap.add_argument("--rowwise", action="store_true",
                    help="try only the CUDA-core tiles that take the row-wise accumulators at 1-2 rows, plus the "
                         "shape's current table entry (so never worse)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--table", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    t_start = time.perf_counter()
    rows, entries = [], []
    shapes = MODEL_SHAPES[args.model]
    wanted = set(args.shapes.split(",")) if args.shapes else set(shapes)
    for op in args.ops.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            for shape in (s for s in op_shapes(shapes)[op] if s in wanted):
                n, k = shapes[shape]
                nbytes = n * k * 2
                case = Case(op, m, n, k, weight_copies(n, k), dev, gated_case(op, shape))
                tuned = S._tuned_table(name).get((op, S.m_bucket(m), n, k))
                if args.prefetch:
                    configs = prefetch_candidates(tuned)
                elif args.rowwise:
                    configs = rowwise_candidates(m) + ([tuned] if tuned else [])
                elif args.dot:
                    configs = dot_candidates() + ([tuned] if tuned else [])
                else:
                    configs = candidates(op, m)
                t = tune_against(case.baseline, case.skinny, configs, len(case.ws), 0.05,
                                 lambda _: time.perf_counter() - t_start > args.budget_s)
                row = dict(op=op, m=m, shape=shape, n=n, k=k, baseline_us=round(t.baseline_us, 2),
                           skinny_us=round(t.best_us, 2), floor_us=round(nbytes / copy_bandwidth() * 1e6, 2),
                           baseline_tbps=round(nbytes / t.baseline_us / 1e6, 2),
                           skinny_tbps=round(nbytes / t.best_us / 1e6, 2), configs_tried=t.tried,
                           best=t.best._asdict() if t.best else None)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if (entry := t.table_entry(op=op, m=m, n=n, k=k)) is not None:
                    entries.append(entry)
                del case
                torch.cuda.empty_cache()
    print(f"\n{'op':>19} {'m':>2} {'shape':>8} {'floor':>7} {'unfused':>7} {'skinny':>7} (us)  best")
    for r in rows:
        print(f"{r['op']:>19} {r['m']:>2} {r['shape']:>8} {r['floor_us']:>7.2f} {r['baseline_us']:>7.2f} "
              f"{r['skinny_us']:>7.2f}  {tuple(r['best'].values()) if r['best'] else None}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=name, torch=torch.__version__, rows=rows), indent=2))
    if args.table:
        tuned_table.merge(args.table, name, entries, S.table_key)


if __name__ == "__main__":
    main()
