"""Times the Gluon block-FP8 GEMM (kernels/fp8_wgmma.py) against the FP8 path the model runs now, at Qwen3-4B's
decode shapes: both from the bf16 activations (the same quantization pass on both sides), CUDA-graph replays,
weights rotated over copies so that L2 does not hold them.

    python3 packages/infer-backend-cuda/scripts/bench_fp8_wgmma.py --ms 16,32,64,96,128 --json out.json

Prints, per shape and row count, the current path's time, the Gluon kernel's at each stage count, the floor (FP8
weight bytes at the GPU's copy rate) and the largest difference between the two outputs relative to their scale.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_skinny_gemm import MODEL_SHAPES
from graph_timing import copy_bandwidth, graph_replay_us
from infer_backend_cuda.kernels import fp8_gemm as F8, fp8_wgmma as W

GROUP = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ms", default="16,32,64,96,128")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--stages", default="3,4,6")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    print(f"{'shape':>8} {'m':>4} {'floor':>7} {'current':>8} " + " ".join(f"{'st' + s:>7}" for s in
                                                                         args.stages.split(",")) + "  max diff (us)")
    for shape in args.shapes.split(","):
        n, k = MODEL_SHAPES["qwen3-4b"][shape]
        ws = [(torch.randn((n, k), device=dev) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
              for _ in range(args.copies)]
        scale_inv = torch.rand((-(-n // GROUP), -(-k // GROUP)), device=dev) * 1e-3 + 1e-4
        scale_row = (torch.arange(n, device=dev) // GROUP).to(torch.int32)
        floor = n * k / copy_bandwidth() * 1e6
        for m in map(int, args.ms.split(",")):
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
            current = graph_replay_us(lambda i: F8.fp8_block_linear(x, ws[i % args.copies], scale_inv, scale_row,
                                                                     GROUP), args.copies * 4)
            ref = F8.fp8_block_linear(x, ws[0], scale_inv, scale_row, GROUP).float()
            row = {"shape": shape, "m": m, "n": n, "k": k, "floor_us": round(floor, 2), "current_us": round(current, 2)}
            for stages in map(int, args.stages.split(",")):
                def call(i: int, stages: int = stages) -> torch.Tensor:
                    q, s = F8.fp8_quantize_activation(x, GROUP)
                    return W.fp8_wgmma_linear(q, s, ws[i % args.copies], scale_inv, scale_row, x.dtype,
                                              stages=stages)
                try:
                    row[f"stages{stages}_us"] = round(graph_replay_us(call, args.copies * 4), 2)
                    diff = (call(0).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                    row[f"stages{stages}_diff"] = diff
                except Exception as exc:  # noqa: BLE001 - a config that does not compile or launch: reported
                    row[f"stages{stages}_us"] = float("nan")
                    row[f"stages{stages}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
            cells = " ".join(f"{row[f'stages{s}_us']:7.2f}" for s in args.stages.split(","))
            diffs = max((row.get(f"stages{s}_diff", 0.0) for s in args.stages.split(",")), default=0.0)
            print(f"{shape:>8} {m:4d} {floor:7.2f} {current:8.2f} {cells}  {diffs:.1e}", flush=True)
            for s in args.stages.split(","):
                if f"stages{s}_error" in row:
                    print(f"         stages {s}: {row[f'stages{s}_error']}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
