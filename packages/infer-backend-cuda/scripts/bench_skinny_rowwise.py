"""The skinny GEMM's row-wise accumulators (a config's `rowwise`) against its 3D product, kernel by kernel, at 1-2
rows on Qwen3-4B's decode shapes: the plain GEMM, the gated gate / up GEMM and the RMSNorm prologue, each over
the CUDA-core tiles that `rowwise_fits` and the shape's tuned-table entry.

Run on the GPU machine:  PYTHONPATH=packages/infer-core/src:packages/infer-backend-cuda/src \
    python3 packages/infer-backend-cuda/scripts/bench_skinny_rowwise.py --json out.json
Timed as bench_skinny_gemm.py times (CUDA-graph replays cycling through >= 256 MB of weight copies); each config's
output is checked against the 3D form's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_skinny_gemm import MODEL_SHAPES, Case, rowwise_candidates, weight_copies
from graph_timing import copy_bandwidth, graph_replay_us
from infer_backend_cuda.kernels import skinny_gemm as S

CASES = [("linear", s) for s in ("qkv", "o_proj", "gate_up", "down")] + [("gated", "gate_up")] + [
    ("add_rms_norm_linear", s) for s in ("qkv", "gate_up")]


def run_case(op: str, m: int, n: int, k: int, dev: torch.device) -> list[dict]:
    """`op` "gated": the gate / up GEMM through its SiLU-and-mul epilogue (the `linear` entry's other form)."""
    gated = op == "gated"
    case = Case("linear" if gated else op, m, n, k, weight_copies(n, k), dev, gated)
    tuned = S._tuned_table(torch.cuda.get_device_name(dev)).get(("linear" if gated else op, m, n, k))
    rows = []
    for cfg in rowwise_candidates(m) + ([tuned] if tuned else []):
        flat, rowwise = cfg._replace(rowwise=False), cfg._replace(rowwise=True)
        ref = case.skinny(0, flat).float().clone()
        us3d = graph_replay_us(lambda i: case.skinny(i, flat), len(case.ws), reps=15)
        err = (case.skinny(0, rowwise).float() - ref).abs().max().item()
        if err > 0.02 * ref.abs().max().item() + 1e-2:
            raise RuntimeError(f"{op} m{m} {cfg}: the row-wise form differs by {err}")
        us_rw = graph_replay_us(lambda i: case.skinny(i, rowwise), len(case.ws), reps=15)
        rows.append(dict(op=op, m=m, n=n, k=k, config=flat._asdict(), table=cfg is tuned,
                         fits=S.rowwise_fits(cfg, 2), us_3d=round(us3d, 2), us_rowwise=round(us_rw, 2)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = MODEL_SHAPES["qwen3-4b"]
    results = []
    print(f"{torch.cuda.get_device_name(dev)}; us per call, 3D -> row-wise", flush=True)
    for m in (int(v) for v in args.ms.split(",")):
        for op, shape in CASES:
            n, k = shapes[shape]
            rows = run_case(op, m, n, k, dev)
            results += rows
            best3d = min(rows, key=lambda r: r["us_3d"])
            best_rw = min(rows, key=lambda r: r["us_rowwise"])
            table = next((r for r in rows if r["table"]), None)
            floor = n * k * 2 / copy_bandwidth() * 1e6
            print(f"{op:>19} m{m} {shape:>8} floor {floor:6.2f}  table "
                  + (f"{table['us_3d']:6.2f} -> {table['us_rowwise']:6.2f}" if table else "  none")
                  + f"  best 3D {best3d['us_3d']:6.2f} {tuple(best3d['config'].values())[:3]}"
                  + f"  best row-wise {best_rw['us_rowwise']:6.2f} {tuple(best_rw['config'].values())[:3]}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev), rows=results), indent=2))


if __name__ == "__main__":
    main()
