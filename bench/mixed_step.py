"""What a prompt chunk costs beside running decodes: the step time of `--decodes` decoding sequences (each at
`--context` tokens) plus one chunk of a `--prompt`-token prompt (its last chunk, so that it attends to the most
prefix), by chunk size, as the worker runs it (mixed-step graph, padded to its token bucket, or eager past the
largest), on the CUDA backend with dummy weights. It sizes the scheduler's `prefill_tokens_while_decoding` cap:
the largest chunk whose step stays within an inter-token-latency budget, and the prompt's TTFT that follows.

    python bench/mixed_step.py --model-dir bench/models/qwen3-4b --decodes 12 --context 3000 --prompt 3000 \\
        --chunks 0,254,500,756,1012,2036 --capture-tokens 64,128,256,512,768,1024,2048

Per chunk: the step's tokens, the graph bucket it ran in (or "eager"), the median wall time of the runner's whole
step (launch, replay or eager forward, sampled ids back), and the model's GEMM TFLOP/s over it (2 x parameters x
tokens). `--eager` also times each step on the eager runner.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from decode_roofline import commit, prefill_in_groups
from torch_profile import device_timeline, print_ranked, ranked
from infer_core.dtypes import DType
from infer_protocol.config import Config
from infer_worker.application.cache_layout import allocate_caches
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.domain.sequence import GREEDY, ScheduledSeq, Sequence
from infer_worker.infrastructure.backend_registry import create_backend
from infer_worker.infrastructure.model_loader import load_model


def gemm_params(model) -> int:  # noqa: ANN001 - a CausalLM
    """Weights a token multiplies through (each storage once: fused slots share one), the embedding and lm_head
    left out (a lookup; the logits of the sampled rows only)."""
    storages = {}
    for name, slot in model.weight_slots().items():
        if "embed" not in name and "lm_head" not in name:
            storage = slot.tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes() // slot.tensor.element_size()
    return sum(storages.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/models/qwen3-4b"))
    ap.add_argument("--decodes", type=int, default=12)
    ap.add_argument("--context", type=int, default=3000, help="each decoding sequence's context")
    ap.add_argument("--prompt", type=int, default=3000, help="the prompt whose last chunk the step carries")
    ap.add_argument("--chunks", default="0,254,500,756,1012,2036")
    ap.add_argument("--capture-tokens", default="64,128,256,512,1024,2048")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="time each step on the eager runner too")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-seqs", type=int, default=Config().mixed_graph_chunk_seqs,
                    help="the mixed graphs' bound on prompt chunks a step (Config.mixed_graph_chunk_seqs, whose "
                    "default it takes; 0: none)")
    ap.add_argument("--profile", default="", help="chunk sizes whose steps' kernels are ranked (torch.profiler, "
                    "PDL overlap inflates kernel times)")
    ap.add_argument("--trace-dir", type=Path, default=None, help="the profiled steps' chrome traces written here "
                    "(mixed_chunk<N>.json), each summarised as a device timeline (idle gaps, busy time per stream)")
    ap.add_argument("--backend", default="cuda", help="cpu: a dry run of the script (eager only)")
    ap.add_argument("--out", type=Path, default=Path("mixed_step.json"))
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    capture_tokens = [int(t) for t in args.capture_tokens.split(",") if t]

    backend = create_backend(args.backend, "cuda:0" if args.backend == "cuda" else "cpu")
    dtype = DType.BFLOAT16 if args.backend == "cuda" else DType.FLOAT32
    model, spec = load_model(args.model_dir, backend, dtype, "dummy", 0)
    params = gemm_params(model)
    profiled = [c for c in args.profile.split(",") if c]
    n_steps = len(chunks) * (args.steps + 2) * (2 if args.eager else 1) + 3 * len(profiled) + 8
    decode_blocks = math.ceil((args.context + n_steps) / args.block_size)
    prompt_blocks = math.ceil((args.prompt + 1) / args.block_size)
    caches = allocate_caches(backend, spec, args.decodes * decode_blocks + prompt_blocks, args.block_size,
                             dtype, 0, spec.num_kv_heads)
    runner_args = (model, backend, caches.per_layer, args.block_size, max(decode_blocks, prompt_blocks),
                   backend.device)
    eager = ModelRunner(*runner_args)
    graph, capture_s = eager, 0.0
    if backend.supports_graphs:
        sizes = [1 << i for i in range(max(1, (args.decodes + 1).bit_length()) + 1)]  # the decodes + the prompt fit
        graph = GraphModelRunner(*runner_args, capture_sizes=sizes, capture_tokens=capture_tokens,
                                 mixed_chunk_seqs=args.chunk_seqs)
        t0 = time.perf_counter()
        graph.capture()
        capture_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    decodes = [Sequence(i, torch.randint(0, spec.vocab_size, (args.context,), generator=gen).tolist(), 0,
                        list(range(i * decode_blocks, (i + 1) * decode_blocks)), GREEDY)
               for i in range(args.decodes)]
    prefill_in_groups(eager, decodes, size=4)
    first = args.decodes * decode_blocks
    prompt = Sequence(args.decodes, torch.randint(0, spec.vocab_size, (args.prompt,), generator=gen).tolist(), 0,
                      list(range(first, first + prompt_blocks)), GREEDY)
    for start in range(0, args.prompt, 2048):  # its KV, so that each timed chunk attends to a real prefix
        n = min(2048, args.prompt - start)
        eager.execute([ScheduledSeq(prompt, n)])
        prompt.num_computed += n

    def step(runner: ModelRunner, chunk: int) -> float:
        work = [ScheduledSeq(s, 1) for s in decodes]
        if chunk:
            prompt.num_computed = args.prompt - chunk  # its last chunk again (the same KV rewritten)
            work.append(ScheduledSeq(prompt, chunk))
        t = time.perf_counter()
        out = runner.execute(work)
        elapsed = time.perf_counter() - t
        for s, tok in zip(decodes, out.token_ids):
            s.num_computed += 1
            s.token_ids.append(tok)
        return elapsed

    rows = []
    for chunk in chunks:
        tokens = args.decodes + chunk
        bucket = graph._bucket([ScheduledSeq(s, 1) for s in decodes] + ([ScheduledSeq(prompt, chunk)] if chunk else [])
                               ) if isinstance(graph, GraphModelRunner) else None
        row = {"chunk": chunk, "tokens": tokens, "graph": f"{bucket[2]} {bucket[0]}" if bucket else "eager"}
        for name, runner in (("graph", graph), ("eager", eager)):
            if name == "eager" and not args.eager:
                continue
            for _ in range(2):
                step(runner, chunk)
            row[f"{name}_ms"] = statistics.median(step(runner, chunk) for _ in range(args.steps)) * 1e3
        row["tflops"] = 2 * params * tokens / (row["graph_ms"] * 1e-3) / 1e12 if params else 0.0
        if str(chunk) in profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step(graph, chunk)
                torch.cuda.synchronize()
            row["top_kernels"], total = ranked(prof, 16, on_device=True, kernels_only=True)
            print(f"chunk {chunk}: 3 steps, kernels")
            print_ranked(row["top_kernels"], total, "kernel")
            if args.trace_dir is not None:
                args.trace_dir.mkdir(parents=True, exist_ok=True)
                trace = args.trace_dir / f"mixed_chunk{chunk}.json"
                prof.export_chrome_trace(str(trace))
                row["timeline"] = device_timeline(trace)
                row["device_step_ms"] = statistics.median(row["timeline"]["step_spans_us"]) / 1e3
                print(f"chunk {chunk}: 3 steps, device timeline (us) {json.dumps(row['timeline'])}")
                print(f"chunk {chunk}: device time a step (median of the profiled steps) "
                      f"{row['device_step_ms']:.3f} ms")
        rows.append(row)
        print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name(0) if args.backend == "cuda" else "cpu"
    report = {"gpu": gpu, "model": str(args.model_dir), "commit": commit(),
              "decodes": args.decodes, "context": args.context, "prompt": args.prompt, "params": params,
              "capture_tokens": capture_tokens, "capture_s": capture_s, "results": rows}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'chunk':>6} {'tokens':>6} {'graph':>12} {'step ms':>8} {'eager ms':>8} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['chunk']:>6} {r['tokens']:>6} {r['graph']:>12} {r['graph_ms']:>8.2f} "
              f"{r.get('eager_ms', float('nan')):>8.2f} {r['tflops']:>8.0f}")


if __name__ == "__main__":
    main()
