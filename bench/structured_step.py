"""The served step of one decode batch by kind of row, on the CUDA runner (dummy weights): where a constrained
row's cost goes (issue 20: the per-step mask cost apart, next to the step it sits in).

Kinds, each at `--batch` rows of `--context` tokens, greedy:
- `decode graph`: every row plain (the decode CUDA graph, sampling inside it);
- `processing`: `--constrained` rows with a min_tokens mask (the decode graph that stops at the logits, then
  logits processing and the sampler eagerly: the path every constrained row takes, without a grammar);
- `grammar`: `--constrained` rows under bench/structured_batch.py's JSON schema (the same path plus the
  matchers: feed, bitmask fill, the mask's copy and apply), each fed its masked argmax;
- `every other`: the grammar rows in every other step only (as they were served before they rode every step);
  the figures are of the steps with them, and `without` those of the steps between.
Per kind: `launch` is the host time until `launch()` returns (what the one-step-ahead pipeline must hide behind
the previous step), `step` the time until the tokens are back, both medians; `mask` (grammar) the time inside
`GrammarBook.mask` alone.

    python3 bench/structured_step.py --model-dir bench/models/qwen3-4b --tokenizer-dir .bench-models/qwen3-4b-dummy
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from infer_core.dtypes import DType
from infer_worker.application.cache_layout import allocate_caches
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.application.structured_output import GrammarBook
from infer_worker.domain.sequence import Grammar, Sampling, ScheduledSeq, Sequence
from infer_worker.infrastructure.backend_registry import create_backend
from infer_worker.infrastructure.grammar_tokenizer import tokenizer_info_factory
from infer_worker.infrastructure.model_loader import load_model
from decode_roofline import prefill_in_groups
from structured_batch import SCHEMA


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/models/qwen3-4b"))
    ap.add_argument("--tokenizer-dir", type=Path, default=Path(".bench-models/qwen3-4b-dummy"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--constrained", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--backend", default="cuda", help="cpu: the same kinds eagerly (a smoke run of this script)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(args.tokenizer_dir)).eos_token_id
    backend = create_backend(args.backend, "cuda:0" if args.backend == "cuda" else "cpu")
    model, spec = load_model(args.model_dir, backend, DType.BFLOAT16, "dummy", 0)
    kinds = ("decode graph", "processing", "grammar", "every other")
    max_len = args.context + len(kinds) * (args.steps + 3) + 8
    blocks_per_seq = math.ceil(max_len / args.block_size)
    b = args.batch
    caches = allocate_caches(backend, spec, b * blocks_per_seq, args.block_size, DType.BFLOAT16, b,
                             spec.num_kv_heads)
    runner_args = (model, backend, caches.per_layer, args.block_size, blocks_per_seq, backend.device)
    if args.backend == "cuda":
        runner = GraphModelRunner(*runner_args, state_pools=caches.state_pools, capture_sizes=[b], capture_tokens=[b])
        runner.capture()
    else:
        runner = ModelRunner(*runner_args, state_pools=caches.state_pools)
    counts = ("graph_steps", "decode_logits_steps", "mixed_graph_steps", "eager_steps")
    book = GrammarBook(tokenizer_info_factory(args.tokenizer_dir), spec.vocab_size)
    runner.grammars = book
    gen = torch.Generator().manual_seed(0)
    plain = Sampling(temperature=0.0)
    seqs = [Sequence(i, torch.randint(0, spec.vocab_size, (args.context,), generator=gen).tolist(), 0,
                     list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), plain, prompt_len=args.context,
                     stop_token_ids=(eos,))
            for i in range(b)]
    prefill_in_groups(runner, seqs)
    rows = [i * (b // args.constrained) for i in range(args.constrained)]  # spread through the batch
    grammar = Grammar("json_schema", json.dumps(SCHEMA, sort_keys=True))
    mask_s: list[float] = []
    timed_mask = book.mask

    def mask(*a, **kw):  # noqa: ANN002, ANN003, ANN202 - GrammarBook.mask, timed
        t = time.perf_counter()
        try:
            return timed_mask(*a, **kw)
        finally:
            mask_s.append(time.perf_counter() - t)

    book.mask = mask  # type: ignore[method-assign]
    report = {"gpu": torch.cuda.get_device_name(0) if args.backend == "cuda" else "cpu", "model": str(args.model_dir), "batch": b,
              "constrained": args.constrained, "context": args.context, "kinds": {}}
    print(f"{'kind':<14} {'launch ms':>9} {'step ms':>8} {'mask ms':>8}   (medians of {args.steps} steps, batch {b}, "
          f"{args.constrained} rows of the kind)")
    for kind in kinds:
        for row in rows:
            s = seqs[row]
            if kind == "processing":
                s.sampling = Sampling(temperature=0.0, min_tokens=10**6)
                s.process_until = 2**62  # (what Sequence sets from min_tokens at construction)
            elif kind == "grammar":
                s.process_until = 0  # book.admit routes it again
                s.sampling = Sampling(temperature=0.0, structured=grammar)
                s.prompt_len = len(s.token_ids)  # the matcher reads from here on
                book.admit(s)
        mask_s.clear()
        launch, step, between = [], [], []
        for i in range(args.steps + 3):
            alternate = kind == "every other" and i % 2 == 1
            batch = [s for j, s in enumerate(seqs) if not (alternate and j in rows)]
            t = time.perf_counter()
            launched = runner.launch([ScheduledSeq(s, 1) for s in batch])
            t_launch = time.perf_counter() - t
            out = launched.result()
            t_step = time.perf_counter() - t
            if launched.seq_errors:
                raise SystemExit(f"{kind}: rows failed: {launched.seq_errors}")
            for s, tok in zip(batch, out.token_ids):
                s.num_computed += 1
                s.token_ids.append(tok)
            if i >= 3:
                (between if alternate else step).append(t_step)
                if not alternate:
                    launch.append(t_launch)
        ms = {"launch_ms": statistics.median(launch) * 1e3, "step_ms": statistics.median(step) * 1e3,
              "mask_ms": statistics.median(mask_s[3:]) * 1e3 if mask_s[3:] else None,
              "without_step_ms": statistics.median(between) * 1e3 if between else None,
              **{c: getattr(runner, c, None) for c in counts}}
        report["kinds"][kind] = ms
        mask_txt = f"{ms['mask_ms']:8.3f}" if ms["mask_ms"] is not None else f"{'-':>8}"
        without = f", without: step {ms['without_step_ms']:.3f}" if between else ""
        print(f"{kind:<14} {ms['launch_ms']:9.3f} {ms['step_ms']:8.3f} {mask_txt}   (graph/mixed/eager steps so "
              f"far {'/'.join(str(ms[c]) for c in counts)}{without})", flush=True)
    sample = seqs[rows[0]]
    report["grammar_sample"] = AutoTokenizer.from_pretrained(str(args.tokenizer_dir)).decode(
        sample.token_ids[sample.prompt_len:])
    print("a grammar row's output:", report["grammar_sample"][:160])
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
