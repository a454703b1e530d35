"""Where a long prefill's time goes: one eager prefill of `--tokens` tokens (in `--chunk`-token steps, as the
scheduler chunks it) on dummy weights, under torch.profiler, with the kernels ranked by their total device time.

    python bench/prefill_profile.py --model-dir bench/models/qwen3.5-4b --tokens 16384 --chunk 8192

Prints the step times (CUDA events) and the top kernels; `--out` writes both as JSON. `--backend cpu` runs the
same on the CPU reference (a dry run with a small model; the table then ranks CPU ops).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from infer_core.dtypes import DType
from infer_worker.application.cache_layout import allocate_caches
from infer_worker.application.model_runner import ModelRunner
from infer_worker.domain.sequence import GREEDY, ScheduledSeq, Sequence
from infer_worker.infrastructure.backend_registry import create_backend
from infer_worker.infrastructure.model_loader import load_model
from torch_profile import print_ranked, ranked


def prefill(runner: ModelRunner, vocab: int, tokens: int, chunk: int, slot: int, block_size: int) -> list[float]:
    """Seconds per chunk of one `tokens`-long prompt, synchronised after each chunk."""
    gen = torch.Generator().manual_seed(0)
    seq = Sequence(0, torch.randint(0, vocab, (tokens,), generator=gen).tolist(), 0,
                   list(range(math.ceil((tokens + 1) / block_size))), GREEDY, state_slot=slot)
    times = []
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        t = time.perf_counter()
        out = runner.execute([ScheduledSeq(seq, n)])
        runner.backend.synchronize()
        times.append(time.perf_counter() - t)
        seq.num_computed += n
        if seq.num_computed == tokens:
            seq.token_ids.append(out.token_ids[0])
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=Path("bench/models/qwen3.5-4b"))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    backend = create_backend(args.backend, "", DType.BFLOAT16)
    model, spec = load_model(args.model_dir, backend, DType.BFLOAT16, "dummy", 0)
    blocks = math.ceil((args.tokens + 1) / args.block_size)
    caches = allocate_caches(backend, spec, blocks, args.block_size, DType.BFLOAT16, 1, spec.num_kv_heads)
    runner = ModelRunner(model, backend, caches.per_layer, args.block_size, blocks, backend.device,
                         state_pools=caches.state_pools)
    slot = 1 if caches.state_pools else 0
    warm = prefill(runner, spec.vocab_size, args.tokens, args.chunk, slot, args.block_size)  # compiles here
    timed = prefill(runner, spec.vocab_size, args.tokens, args.chunk, slot, args.block_size)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.backend == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        prefill(runner, spec.vocab_size, args.tokens, args.chunk, slot, args.block_size)
    rows, total_ms = ranked(prof, args.top, on_device=args.backend == "cuda")
    print(f"prefill of {args.tokens} tokens in chunks of {args.chunk}: first run {sum(warm):.3f} s (compiles), "
          f"then {sum(timed):.3f} s ({', '.join(f'{t * 1e3:.0f}' for t in timed)} ms per chunk)")
    print_ranked(rows, total_ms)
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model_dir), "tokens": args.tokens, "chunk": args.chunk,
                                        "chunk_s": timed, "top": rows}, indent=2))


if __name__ == "__main__":
    main()
