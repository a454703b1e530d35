"""Decode step time against the HBM roofline, on the CUDA backend with dummy weights.

Floor per step = (weight bytes + KV bytes the step reads) / measured copy bandwidth. Reports, per batch size,
the median of the pure graph replay (GPU time, CUDA events) and of the served runner step (host prep + replay
+ the token copy back), and eager vs graph at the sizes in --eager-batches.

    python bench/decode_roofline.py --model-dir bench/models/qwen3-4b --batches 1,8,32,64,128,256

`--profile` adds, per batch size, a torch.profiler pass over `--profile-steps` graph replays (eager decode steps
where the profiler sees no kernel inside the graph), printing the top 12 device kernels by total time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from infer_core.dtypes import DType
from infer_worker.application.cache_layout import allocate_caches, state_geometry
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.domain.sequence import GREEDY, ScheduledSeq, Sequence
from infer_worker.infrastructure.backend_registry import create_backend
from infer_worker.infrastructure.model_loader import load_model
from torch_profile import print_ranked, ranked


def weight_bytes(model) -> int:  # noqa: ANN001 - a CausalLM
    """Bytes of every weight as stored (int4 codes, fp8 and their scales included), each storage counted once
    (fused qkv slots share one; a tied lm_head is the embedding)."""
    storages = {}
    for slot in model.weight_slots().values():
        storage = slot.tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def copy_bandwidth() -> float:
    """Device-to-device copy, read + write bytes per second (the ceiling a decode step can reach)."""
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); y.copy_(x); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * 2 * 2**30 / statistics.median(times)


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def profile_steps(batch: int, steps: int, replay, eager_step) -> list[dict]:  # noqa: ANN001 - callables
    """The top 12 device kernels of `steps` graph replays, or of eager steps where the profiler records no
    kernel inside the graph (CUPTI builds without graph-node tracing)."""
    for name, step in (("graph replays", replay), ("eager steps", eager_step)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        rows, total_ms = ranked(prof, 12, on_device=True, kernels_only=True)
        if rows:
            print(f"batch {batch}: {steps} {name}")
            print_ranked(rows, total_ms, "kernel")
            return rows
    return []


def prefill_in_groups(runner: ModelRunner, seqs: list[Sequence], size: int = 16) -> None:
    """Prefill every sequence whole, `size` at a time (bounded activation memory), each left with its first token."""
    for start in range(0, len(seqs), size):
        group = seqs[start:start + size]
        out = runner.execute([ScheduledSeq(s, s.num_tokens) for s in group])
        for s, tok in zip(group, out.token_ids):
            s.num_computed = s.num_tokens
            s.token_ids.append(tok)


class DecodeBench(NamedTuple):
    """A dummy-weight BF16 model on the CUDA backend with KV pages for `max_batch` sequences of `blocks_per_seq`
    pages each (sequence i owns pages `[i * blocks_per_seq, (i + 1) * blocks_per_seq)`)."""

    backend: Any
    model: Any
    spec: Any
    caches: Any
    block_size: int
    blocks_per_seq: int

    @property
    def runner_args(self) -> tuple:
        """The leading arguments of `ModelRunner` / `GraphModelRunner` (pass `state_pools=caches.state_pools`)."""
        return (self.model, self.backend, self.caches.per_layer, self.block_size, self.blocks_per_seq,
                self.backend.device)


def decode_bench(model_dir: Path, max_batch: int, max_len: int, block_size: int) -> DecodeBench:
    backend = create_backend("cuda", "cuda:0")
    model, spec = load_model(model_dir, backend, DType.BFLOAT16, "dummy", 0)
    blocks_per_seq = math.ceil(max_len / block_size)
    caches = allocate_caches(backend, spec, max_batch * blocks_per_seq, block_size, DType.BFLOAT16, max_batch,
                             spec.num_kv_heads)
    return DecodeBench(backend, model, spec, caches, block_size, blocks_per_seq)


def random_seqs(bench: DecodeBench, count: int, context: int, gen: torch.Generator) -> list[Sequence]:
    """`count` greedy sequences of `context` random prompt tokens on their own pages (and state slots, for a model
    with linear-attention layers)."""
    stateful = state_geometry(bench.spec, DType.BFLOAT16) is not None
    return [Sequence(i, torch.randint(0, bench.spec.vocab_size, (context,), generator=gen).tolist(), 0,
                     list(range(i * bench.blocks_per_seq, (i + 1) * bench.blocks_per_seq)), GREEDY,
                     state_slot=(i + 1) if stateful else 0)
            for i in range(count)]


def decode_once(runner: ModelRunner, seqs: list[Sequence]) -> float:
    """One decode step of every sequence, each left with its new token; the step's wall time in seconds."""
    t = time.perf_counter()
    out = runner.execute([ScheduledSeq(s, 1) for s in seqs])
    elapsed = time.perf_counter() - t
    for s, tok in zip(seqs, out.token_ids):
        s.num_computed += 1
        s.token_ids.append(tok)
    return elapsed


def replay_times_ms(graph: torch.cuda.CUDAGraph, steps: int) -> list[float]:
    """GPU time of `steps` replays of a captured graph, each timed alone with CUDA events."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); graph.replay(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, default=Path("bench/models/qwen3-4b"))
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--eager-batches", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("decode_roofline.json"))
    ap.add_argument("--profile", action="store_true", help="rank the kernels of a few steps per batch size")
    ap.add_argument("--profile-steps", type=int, default=5)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    eager_batches = {int(b) for b in args.eager_batches.split(",") if b}

    max_len = args.context + 3 * args.steps + 8 + (args.profile_steps if args.profile else 0)
    bench = decode_bench(args.model_dir, max(batches), max_len, args.block_size)
    model, spec, caches = bench.model, bench.spec, bench.caches
    bandwidth = copy_bandwidth()
    wbytes = weight_bytes(model)
    # A hybrid model's linear-attention layers read and write a fixed state per sequence instead of KV.
    kv_per_token = 2 * spec.num_attention_layers * spec.num_kv_heads * spec.head_dim * 2
    geometry = state_geometry(spec, DType.BFLOAT16)
    state_bytes_per_seq = 2 * geometry.bytes_per_slot if geometry else 0
    graph = GraphModelRunner(*bench.runner_args, state_pools=caches.state_pools, capture_sizes=batches)
    t0 = time.perf_counter()
    graph.capture()
    capture_s = time.perf_counter() - t0
    eager = ModelRunner(*bench.runner_args, state_pools=caches.state_pools)
    gen = torch.Generator().manual_seed(0)
    results = []
    for b in batches:
        seqs = random_seqs(bench, b, args.context, gen)
        prefill_in_groups(eager, seqs)
        row = {"batch": b}
        for name, runner in (("graph", graph), ("eager", eager)):
            if name == "eager" and b not in eager_batches:
                continue
            for _ in range(3):
                decode_once(runner, seqs)
            times = [decode_once(runner, seqs) for _ in range(args.steps)]
            row[f"{name}_step_ms"] = statistics.median(times) * 1e3
        # Pure GPU time of one replay at this size (inputs as left by the last step).
        size = min(s for s in graph.capture_sizes if s >= b)
        g = graph._graphs[(size, True)]
        gpu = replay_times_ms(g, args.steps)
        ctx = statistics.mean(s.num_computed for s in seqs)
        floor_ms = (wbytes + b * (ctx * kv_per_token + state_bytes_per_seq)) / bandwidth * 1e3
        row.update(replay_gpu_ms=statistics.median(gpu), floor_ms=floor_ms,
                   replay_over_floor=statistics.median(gpu) / floor_ms, context=ctx)
        if args.profile:
            row["top_kernels"] = profile_steps(b, args.profile_steps, g.replay, lambda: decode_once(eager, seqs))
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "gpu": torch.cuda.get_device_name(0), "model": str(args.model_dir), "dtype": "bfloat16",
        "weight_bytes": wbytes, "state_bytes_per_seq": state_bytes_per_seq, "copy_bandwidth_Bps": bandwidth,
        "capture_s": capture_s, "commit": commit(),
        "torch": torch.__version__, "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'batch':>5} {'floor':>8} {'replay':>8} {'graph step':>10} {'eager step':>10}  (ms, medians)")
    for r in results:
        print(f"{r['batch']:>5} {r['floor_ms']:>8.3f} {r['replay_gpu_ms']:>8.3f} {r['graph_step_ms']:>10.3f} "
              f"{r.get('eager_step_ms', float('nan')):>10.3f}")


if __name__ == "__main__":
    main()
