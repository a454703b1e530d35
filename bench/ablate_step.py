"""What each part of a decode step costs inside the step: graph replays with one part taken out, against the whole.

A profile of a PDL-chained step overlaps kernels (a kernel's launch and prologue run under its predecessor's tail),
so per-kernel times do not add up to the step and cannot say what removing or fusing one would save. Here each
ablation captures the step again with one part made free (its output left as `torch.empty`, no kernel), and the
saving is the replay's drop: an upper bound on what a faster or fused version of that part could give.

    python bench/ablate_step.py --model-dir bench/models/qwen3-4b --batches 1,2,4,16,64,128 \\
        --ablations none,norms,attention,qkv_proj,o_proj,gate_up_proj,down_proj,lm_head

Ablations: `none`; `norms` (every add + RMSNorm / RMSNorm kernel: the residual stream is not added; a norm fused into
a GEMM's prologue, as the skinny table's `add_rms_norm_linear` entries do, stays); `attention` (the
decode attention launch, with the q/k norm, RoPE and KV store it fuses); a linear's attribute name (`qkv_proj`,
`o_proj`, `gate_up_proj`, `down_proj`, `lm_head`, ...: that GEMM in every layer, its norm and activation kept);
`gemms` (every linear). The values a step computes are garbage under an ablation; only its time is read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch

from decode_roofline import commit, decode_bench, decode_once, prefill_in_groups, random_seqs, replay_times_ms
from infer_backend_cuda import kernels
from infer_core.ports.fused_ops import unfused_add_rms_norm_linear
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.components.linear import Linear


def named_linears(root: object) -> list[tuple[str, Linear]]:
    """Every `Linear` reachable from the model's attributes and lists, with its attribute name (the last one)."""
    found, seen, stack = [], set(), [("", root)]
    while stack:
        name, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float, bool)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, Linear):
            found.append((name, obj))
        elif isinstance(obj, (list, tuple)):
            stack += [(name, item) for item in obj]
        elif type(obj).__module__.startswith("infer_worker"):
            stack += list(vars(obj).items()) if hasattr(obj, "__dict__") else []
    return found


def out_features(linear: Linear) -> int:
    tensors = linear.params.tensors
    return tensors["scales"].shape[1] if "scales" in tensors else tensors["weight"].shape[0]


class FreeGemm:
    """A linear's ops with the GEMM made free: its output `torch.empty`, the norm before it still run."""

    def __init__(self, fused: object, n: int) -> None:
        self._fused = fused
        self._n = n

    def linear(self, x: torch.Tensor, weight: object, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], self._n))

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias):  # noqa: ANN001, ANN201 - LinearOps
        return unfused_add_rms_norm_linear(self._fused, self.linear, x, residual, norm_weight, eps, weight, bias)

    def add_rms_norm_linear_silu_mul(self, x, residual, norm_weight, eps, weight, bias):  # noqa: ANN001, ANN201
        out, h = self.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
        return out[..., : self._n // 2], h


@contextlib.contextmanager
def ablated(name: str, model: object, fused: object) -> Iterator[None]:
    """The model's ops with `name` made free, restored on exit."""
    undo: list[tuple[object, str, object]] = []

    def swap(owner: object, attr: str, value: object) -> None:
        undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    if name == "norms":
        swap(kernels, "rms_norm", lambda x, weight, eps, **_: x)
        swap(kernels, "add_rms_norm", lambda x, residual, weight, eps, **_: (x, residual))
    elif name == "attention":
        swap(kernels, "paged_attention_decode",
             lambda q, *args, out=None, **_: out if out is not None else torch.empty_like(q))
    elif name != "none":
        linears = [lin for attr, lin in named_linears(model) if name in ("gemms", attr)]
        if not linears:
            raise SystemExit(f"no part {name!r}: linears are {sorted({a for a, _ in named_linears(model)})}")
        for lin in linears:
            swap(lin, "_ops", FreeGemm(fused, out_features(lin)))
    try:
        yield
    finally:
        for owner, attr, value in reversed(undo):
            setattr(owner, attr, value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, default=Path("bench/models/qwen3-4b"))
    ap.add_argument("--batches", default="1,2,4,16,64,128")
    ap.add_argument("--ablations", default="none,norms,attention,qkv_proj,o_proj,gate_up_proj,down_proj,lm_head")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("ablate_step.json"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ablations = args.ablations.split(",")

    bench = decode_bench(args.model_dir, max(batches), args.context + 2 * len(ablations) + 8, args.block_size)
    eager = ModelRunner(*bench.runner_args, state_pools=bench.caches.state_pools)
    fused = bench.backend.ops.fused
    gen = torch.Generator().manual_seed(0)
    results, kept = [], []
    for b in batches:
        seqs = random_seqs(bench, b, args.context, gen)
        prefill_in_groups(eager, seqs)
        row = {"batch": b}
        for name in ablations:
            with ablated(name, bench.model, fused):
                graph = GraphModelRunner(*bench.runner_args, state_pools=bench.caches.state_pools, capture_sizes=[b])
                graph.capture()
                decode_once(graph, seqs)  # the replay's inputs, as a step leaves them
                row[name] = statistics.median(replay_times_ms(graph._graphs[(b, True)], args.steps))
                kept.append(graph)  # graphs share the backend's pool: freeing one breaks the next capture
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {"gpu": torch.cuda.get_device_name(0), "model": str(args.model_dir), "context": args.context,
              "commit": commit(), "torch": torch.__version__, "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'ablation':>14} " + " ".join(f"{b:>14}" for b in batches) + "   (replay ms; saving against none)")
    for name in ablations:
        cells = []
        for r in results:
            base = r.get("none", math.nan)
            cells.append(f"{r[name]:>7.3f} ({base - r[name]:+.3f})" if name != "none" else f"{r[name]:>14.3f}")
        print(f"{name:>14} " + " ".join(cells))


if __name__ == "__main__":
    main()
