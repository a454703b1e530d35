"""The AWQ GEMMs' one-row configs tuned inside the decode step: each candidate scored by the step's CUDA-graph replay.

`packages/infer-backend-cuda/scripts/bench_quant_gemm.py --table` times a kernel alone, with no kernel before it, so it
cannot credit what a one-row GEMM overlaps under PDL (the GEMV's first group asked for before `gdc_wait`, thirty-third
session) or what its tail costs inside the chain (the fix-up's sum, thirty-fourth). Here one linear's candidates (the
others at their current choice) are each captured into the step's graph, and the replay's median over `--steps`
replays is the score; coordinate descent over the model's AWQ linears, `--rounds` times, the current choice re-timed
in every linear's pass. `--write-table` merges the winners into `configs/awq_gemm.json` for this GPU (row bucket 1),
each entry with the replay it won with (`replay_ms`; the table's `us` entries are kernel times alone).

    python3 bench/tune_awq_in_model.py --model-dir bench/models/qwen3-4b-awq --rounds 1 --out tune_awq.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import triton

from ablate_step import named_linears
from decode_roofline import commit, decode_bench, decode_once, prefill_in_groups, random_seqs, replay_times_ms
from infer_backend_cuda.kernels import awq_gemm, tuned_table
from infer_backend_cuda.kernels.awq_gemm import AwqConfig
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner

Shape = tuple[int, int, int]  # (N, K, group)
# The one-row GEMV's program forms: (columns, K step, warps); each with one or two groups a program.
GEMV_FORMS = ((64, 8, 1), (128, 8, 2), (128, 16, 2), (128, 8, 4), (256, 8, 4))
GROUPS_PER_PROGRAM = (1, 2)


def awq_shapes(model: object) -> dict[str, Shape]:
    """(N, K, group) of each AWQ linear by attribute name (every layer's linear of a name has the same shape)."""
    shapes: dict[str, Shape] = {}
    for attr, linear in named_linears(model):
        tensors = linear.params.tensors
        if "qweight" in tensors:
            k, n = tensors["qweight"].shape[0], tensors["scales"].shape[1]
            shapes[attr] = (n, k, k // tensors["scales"].shape[0])
    return dict(sorted(shapes.items()))


def candidates(n: int, k: int, group: int) -> list[AwqConfig]:
    """One row's configs to try at a shape: the GEMV forms at one and two groups a program, the default rule's choice,
    and the tiled kernel's 16-row decode tile (the form of the H200's one-row o_proj entry), distinct and valid."""
    groups = k // group
    found = [awq_gemm.default_config(1, n, k, group)]
    for block_n, block_k, warps in GEMV_FORMS:
        for per in GROUPS_PER_PROGRAM:
            found.append(AwqConfig(1, block_n, awq_gemm.group_block_k(group, block_k), warps, 1,
                                   triton.cdiv(groups, per)))
    tile_k = awq_gemm.group_block_k(group, 128)
    found.append(AwqConfig(16, 64, tile_k, 4, 3, min(k // tile_k, max(1, 512 // triton.cdiv(n, 64)))))
    return list(dict.fromkeys(found))


@contextlib.contextmanager
def one_row_configs(chosen: Mapping[Shape, AwqConfig]) -> Iterator[None]:
    """`awq_gemm.choose_config` answering `chosen` for one row at those shapes (the tuned table's lookup replaced,
    every other entry kept), restored on exit."""
    original = awq_gemm._tuned_table

    def table(device_name: str) -> dict[tuple[int, int, int, int], AwqConfig]:
        return {**original(device_name), **{(1, *shape): cfg for shape, cfg in chosen.items()}}

    awq_gemm._tuned_table = table
    try:
        yield
    finally:
        awq_gemm._tuned_table = original


def table_entries(chosen: Mapping[Shape, AwqConfig], scores: Mapping[Shape, float]) -> list[dict]:
    """The winners as `configs/awq_gemm.json` entries of row bucket 1."""
    return [{"m": 1, "n": n, "k": k, "group": group, "config": list(cfg), "replay_ms": round(scores[(n, k, group)], 4)}
            for (n, k, group), cfg in chosen.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, default=Path("bench/models/qwen3-4b-awq"))
    ap.add_argument("--context", type=int, default=280)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("tune_awq.json"))
    args = ap.parse_args()

    # one sequence's pages for the prompt and a decode step a trial (~13 a linear a round); a trial past them stops
    bench = decode_bench(args.model_dir, 1, args.context + 64 * args.rounds + 16, args.block_size)
    shapes = awq_shapes(bench.model)
    tries = {shape: candidates(*shape) for shape in shapes.values()}
    if args.context + args.rounds * sum(len(c) + 1 for c in tries.values()) > bench.blocks_per_seq * bench.block_size:
        raise SystemExit("more trials than the sequence's pages hold: raise the 64 a round above")
    seqs = random_seqs(bench, 1, args.context, torch.Generator().manual_seed(0))
    prefill_in_groups(ModelRunner(*bench.runner_args, state_pools=bench.caches.state_pools), seqs)
    device = torch.device("cuda")
    chosen = {shape: awq_gemm.choose_config(1, *shape, device) for shape in tries}
    kept: list[GraphModelRunner] = []  # graphs share the backend's pool: freeing one breaks the next capture

    def replay_ms(trial: Mapping[Shape, AwqConfig]) -> float:
        with one_row_configs(trial):
            graph = GraphModelRunner(*bench.runner_args, state_pools=bench.caches.state_pools, capture_sizes=[1])
            graph.capture()
            decode_once(graph, seqs)  # the replay's inputs, as a step leaves them
            kept.append(graph)
            return statistics.median(replay_times_ms(graph._graphs[(1, True)], args.steps))

    log, scores = [], {}
    for round_ in range(args.rounds):
        for attr, shape in shapes.items():
            timed = [(replay_ms({**chosen, shape: cfg}), cfg) for cfg in [chosen[shape], *tries[shape]]]
            for ms, cfg in timed:
                log.append({"round": round_, "linear": attr, "shape": shape, "config": list(cfg), "replay_ms": ms})
                print(f"round {round_} {attr:<14} {str(list(cfg)):<42} {ms:.4f} ms", flush=True)
            scores[shape], chosen[shape] = min(timed, key=lambda t: t[0])
            print(f"round {round_} {attr:<14} best {list(chosen[shape])} {scores[shape]:.4f} ms", flush=True)
    name = torch.cuda.get_device_name(0)
    entries = table_entries(chosen, scores)
    args.out.write_text(json.dumps({"gpu": name, "model": str(args.model_dir), "context": args.context,
                                    "commit": commit(), "chosen": entries, "trials": log}, indent=2))
    if args.write_table:
        tuned_table.merge(awq_gemm._TABLE, name, entries, awq_gemm.table_key)
        print(f"merged {len(entries)} one-row entries for {name} into {awq_gemm._TABLE}")


if __name__ == "__main__":
    main()
