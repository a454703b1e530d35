"""Structured outputs at batch: the ITL cost of constraining part of a batch with a JSON schema (issue 20's target:
Qwen3-4B dummy on an H200, a quarter of 64 rows under a schema, ITL p50 at most 10% above the unconstrained run).

Server mode (one run): phase A sends `--batch` concurrent streaming chat requests, all unconstrained (ignore_eos);
phase B the same batch with `--schema-fraction` of its rows under `response_format` json_schema SCHEMA (no
ignore_eos: the server refuses it with a grammar), the others as in A. A constrained row's request ends on EOS once
its JSON is complete (~110 tokens); the next one takes its place at once, until the free rows are done, so B keeps
a quarter of its rows under the schema for the whole phase (new constrained requests' prefills included). The
batch is spread over `--clients` processes: one Python process reading 64 streams gets their chunks in bursts, and
the single gaps (vLLM's ITL, the target's metric) would then measure the client, not the server's steps. A and B
alternate `--repeats` times, so drift (clocks, caches) hits both alike. B/A is reported on ITL p50 and on TPOT
p50 (each row's mean gap, then the median over rows). Each constrained output is parsed and validated against
SCHEMA (jsonschema_rs); the ones that do not parse are kept in the JSON.

    python3 bench/structured_batch.py --url http://127.0.0.1:8000 --model qwen3-4b --out $OUT/structured.json

`--mask-microbench` (no server): the per-step mask cost apart. It builds the worker's GrammarBook as the worker
does (assembly.py), admits 16 sequences under SCHEMA and times, on float32 logits [64, vocab] with those 16 rows
constrained, the host share of the served path (the matchers fed their tokens, the bitmasks filled into a host
buffer: what precedes the masked sampling graph's replay) and the eager `mask()` (fill, copy, apply); each step
feeds every row its argmax under the mask, so the matchers walk through the schema (a finished row is replaced by
a fresh sequence, as new requests would arrive).

    python3 bench/structured_batch.py --mask-microbench --device cuda --tokenizer-dir .bench-models/qwen3-4b-dummy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ holds serve_sweep, also when loaded by path
from client_processes import run_in_processes, start_time  # noqa: E402
from serve_sweep import IGNORE_EOS, RequestRecord, commit, one_request, summarize  # noqa: E402

try:  # not on the device image unless its wheel travels (scripts/device_*.sh fetch it)
    import jsonschema_rs
except ImportError:
    jsonschema_rs = None

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 48},
        "category": {"enum": ["book", "film", "album", "game"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4},
        "creator": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 32},
                "born": {"type": "integer", "minimum": 1800, "maximum": 2020},
            },
            "required": ["name", "born"],
            "additionalProperties": False,
        },
        "summary": {"type": "string", "maxLength": 120},
    },
    "required": ["title", "category", "rating", "tags", "creator", "summary"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}

FREE_PROMPTS = (
    "Tell me a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Describe the water cycle to a child.",
    "Write a few lines about autumn in a city.",
    "What makes a good cup of tea?",
    "Summarise the history of the printing press.",
    "Give advice to someone learning to cook.",
    "Describe a walk along a river at dawn.",
)
CONSTRAINED_PROMPTS = (
    "Review your favourite novel as JSON.",
    "Describe a classic film as a JSON review.",
    "Give a JSON review of a music album you like.",
    "Review a board game in JSON.",
)


def _messages(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def check_output(text: str) -> tuple[bool, bool]:
    """(parsed as JSON, validated against SCHEMA); validated is False without jsonschema_rs."""
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    return True, jsonschema_rs is not None and jsonschema_rs.is_valid(SCHEMA, value)


async def _refilled(client: Any, url: str, model: str, slot: int, max_tokens: int,
                    running: asyncio.Event) -> list[RequestRecord]:
    """One constrained row kept busy: each request that ends (on EOS, its JSON complete) is followed by the next,
    until the phase's free rows are done, so a quarter of the batch stays under the schema for the whole phase."""
    records = []
    while True:
        records.append(await one_request(client, url, model,
                                         _messages(CONSTRAINED_PROMPTS[(slot + len(records)) % len(CONSTRAINED_PROMPTS)]),
                                         max_tokens, {"response_format": RESPONSE_FORMAT}))
        if not running.is_set() or not records[-1].ok:
            return records


async def run_phase(url: str, model: str, free_rows: int, constrained: int, max_tokens: int, start_at: float,
                    first_slot: int = 0) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """One client process's share of a batch, sent at wall-clock `start_at`: (free rows, constrained rows)."""
    import httpx

    limits = httpx.Limits(max_connections=free_rows + constrained + 8,
                          max_keepalive_connections=free_rows + constrained + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        running = asyncio.Event()
        running.set()
        free = [asyncio.create_task(one_request(client, url, model,
                                                _messages(FREE_PROMPTS[(first_slot + i) % len(FREE_PROMPTS)]),
                                                max_tokens, IGNORE_EOS)) for i in range(free_rows)]
        bound = [asyncio.create_task(_refilled(client, url, model, first_slot + i, max_tokens, running))
                 for i in range(constrained)]
        free_records = await asyncio.gather(*free)
        running.clear()
        bound_records = [r for records in await asyncio.gather(*bound) for r in records]
    return list(free_records), bound_records


def _client_process(url: str, model: str, free_rows: int, constrained: int, max_tokens: int, start_at: float,
                    first_slot: int) -> tuple[list[RequestRecord], list[RequestRecord]]:
    return asyncio.run(run_phase(url, model, free_rows, constrained, max_tokens, start_at, first_slot))


def run_batch(url: str, model: str, batch: int, constrained: int, max_tokens: int,
              clients: int) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """The batch spread over `clients` processes (one Python process reading 64 streams delivers their chunks in
    bursts, which single gaps, vLLM's ITL, would measure instead of the server's steps); the constrained rows are
    spread over them too."""
    clients = max(1, min(clients, batch))
    shares = [(batch // clients + (i < batch % clients), constrained // clients + (i < constrained % clients))
              for i in range(clients)]
    start_at = start_time(clients)
    if clients == 1:
        return asyncio.run(run_phase(url, model, batch - constrained, constrained, max_tokens, start_at))
    parts = run_in_processes(_client_process, [
        (url, model, rows - bound, bound, max_tokens, start_at, i * batch) for i, (rows, bound) in enumerate(shares)])
    return [r for free, _ in parts for r in free], [r for _, bound in parts for r in bound]


def _itl_ms(records: list[RequestRecord]) -> list[float]:
    return [gap * 1000 for r in records if r.ok for gap in r.itl]


def _tpot_ms(records: list[RequestRecord]) -> list[float]:
    """Each request's mean gap between tokens: unlike single gaps, it does not see chunks that reach the one client
    process in bursts (at batch 64 on the H200 half of the gaps read ~0.04 ms, the rest a step or more)."""
    return [1000 * sum(r.itl) / len(r.itl) for r in records if r.ok and r.itl]


def phase_stats(free: list[RequestRecord], bound: list[RequestRecord], wall: float) -> dict[str, Any]:
    every = _itl_ms(free + bound)
    stats: dict[str, Any] = {
        "wall_s": wall,
        "tpot_p50_ms": summarize(_tpot_ms(free + bound))["p50"],
        "tpot_free_p50_ms": summarize(_tpot_ms(free))["p50"],
        "itl_ms": summarize(every),
        "itl_free_p50_ms": summarize(_itl_ms(free))["p50"],
        "ttft_free_p50_ms": summarize([1000 * r.ttft for r in free if r.ok])["p50"],
        "errors": [r.error for r in free + bound if not r.ok],
        "output_tokens": sum(r.output_tokens for r in free + bound),
    }
    if bound:
        checks = [check_output(r.text) for r in bound if r.ok]
        stats |= {
            "itl_constrained_p50_ms": summarize(_itl_ms(bound))["p50"],
            "tpot_constrained_p50_ms": summarize(_tpot_ms(bound))["p50"],
            # (the refills' TTFT: a grammar row waits at its last prompt token for its compilation, docs/architecture.md)
            "ttft_constrained_p50_ms": summarize([1000 * r.ttft for r in bound if r.ok])["p50"],
            "constrained": len(bound),
            "parsed_json": sum(parsed for parsed, _ in checks),
            "validated": sum(valid for _, valid in checks) if jsonschema_rs is not None else None,
            "finish_reasons": {reason: sum(r.finish_reason == reason for r in bound)
                               for reason in sorted({r.finish_reason for r in bound})},
            "constrained_output_tokens_p50": statistics.median([r.output_tokens for r in bound]),
            "sample_output": bound[0].text[:400],
            "unparsed_outputs": [r.text for r, (parsed, _) in zip((r for r in bound if r.ok), checks) if not parsed],
        }
    return stats


def _median(runs: list[dict[str, Any]], key: str) -> float:
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def server_bench(args: argparse.Namespace) -> dict[str, Any]:
    constrained = round(args.batch * args.schema_fraction)
    # Warm-up, not recorded: the worker builds its grammar compiler (the vocabulary scan) on the first grammar.
    free, bound = run_batch(args.url, args.model, 2, 1, 8, 1)
    if not all(r.ok for r in free + bound):
        raise SystemExit(f"warm-up failed: {[r.error for r in free + bound if not r.ok]}")
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    for repeat in range(args.repeats):
        for phase, rows in (("A", 0), ("B", constrained)):
            start = time.perf_counter()
            free, bound = run_batch(args.url, args.model, args.batch, rows, args.max_tokens, args.clients)
            stats = phase_stats(free, bound, time.perf_counter() - start)
            stats |= {"itl_p50_ms": stats["itl_ms"]["p50"], "itl_p99_ms": stats["itl_ms"]["p99"]}
            runs[phase].append(stats)
            print(f"repeat {repeat} phase {phase}: TPOT p50 {stats['tpot_p50_ms']:.2f} ms, ITL p50 "
                  f"{stats['itl_p50_ms']:.2f} ms, "
                  f"{len(stats['errors'])} errors, {stats['wall_s']:.1f} s", file=sys.stderr)
    summary = {phase: {key: _median(phase_runs, key) for key in
                       ("tpot_p50_ms", "tpot_free_p50_ms", "tpot_constrained_p50_ms", "itl_p50_ms", "itl_p99_ms",
                        "itl_free_p50_ms", "itl_constrained_p50_ms", "ttft_free_p50_ms", "ttft_constrained_p50_ms",
                        "wall_s")}
               for phase, phase_runs in runs.items()}
    summary["B_over_A_tpot_p50"] = summary["B"]["tpot_p50_ms"] / summary["A"]["tpot_p50_ms"]
    summary["B_over_A_free_tpot_p50"] = summary["B"]["tpot_free_p50_ms"] / summary["A"]["tpot_free_p50_ms"]
    summary["B_over_A_itl_p50"] = summary["B"]["itl_p50_ms"] / summary["A"]["itl_p50_ms"]
    return {
        "mode": "server", "url": args.url, "model": args.model, "batch": args.batch,
        "constrained_rows": constrained, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "schema": SCHEMA, "validation": "jsonschema_rs" if jsonschema_rs is not None else "parse only (no jsonschema_rs)",
        "summary": summary, "runs": runs,
    }


def print_server_table(result: dict[str, Any]) -> None:
    s = result["summary"]
    print(f"batch {result['batch']}, {result['constrained_rows']} constrained, max_tokens {result['max_tokens']}, "
          f"medians over {result['repeats']} repeats (ms)")
    print(f"{'phase':<6}{'TPOT p50':>10}{'free':>8}{'constr':>8}{'ITL p50':>10}{'ITL p99':>10}{'wall s':>9}")
    for phase in ("A", "B"):
        row = s[phase]
        print(f"{phase:<6}{row['tpot_p50_ms']:>10.2f}{row['tpot_free_p50_ms']:>8.2f}"
              f"{row['tpot_constrained_p50_ms']:>8.2f}{row['itl_p50_ms']:>10.2f}{row['itl_p99_ms']:>10.2f}"
              f"{row['wall_s']:>9.1f}")
    print(f"B/A ITL p50: {s['B_over_A_itl_p50']:.3f} (target <= 1.10); TPOT p50 {s['B_over_A_tpot_p50']:.3f}, "
          f"free rows {s['B_over_A_free_tpot_p50']:.3f}")
    for i, run in enumerate(result["runs"]["B"]):
        validated = "n/a" if run["validated"] is None else run["validated"]
        print(f"B repeat {i}: parsed {run['parsed_json']}/{run['constrained']}, validated {validated} "
              f"({result['validation']}), finish {run['finish_reasons']}, errors {len(run['errors'])}")


def mask_microbench(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from infer_worker.application.structured_output import GrammarBook
    from infer_worker.domain.sequence import Grammar, Sampling, Sequence
    from infer_worker.infrastructure.grammar_tokenizer import tokenizer_info_factory

    device = torch.device(args.device)
    tokenizer_dir = Path(args.tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SystemExit(f"{tokenizer_dir}: the tokenizer names no EOS token (a grammar needs a stop token)")
    book = GrammarBook(tokenizer_info_factory(tokenizer_dir), args.vocab)
    grammar = Grammar("json_schema", json.dumps(SCHEMA, sort_keys=True))  # canonical, as the server sends it
    prompt = [eos] * 8  # the matcher only reads the generated tokens
    next_id = iter(range(10**9))

    def admitted() -> Sequence:
        seq = Sequence(next(next_id), list(prompt), len(prompt), [], Sampling(temperature=0.0, structured=grammar),
                       prompt_len=len(prompt), stop_token_ids=(eos,))
        book.admit(seq)
        return seq

    rows = [i * (args.batch // args.constrained) for i in range(args.constrained)]  # spread through the batch
    seqs: list[Sequence] = [admitted() if i in rows else
                            Sequence(next(next_id), list(prompt), len(prompt), [], Sampling(temperature=0.0))
                            for i in range(args.batch)]

    def to_device(array: Any) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    generator = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: list[float] = []
    fill_times: list[float] = []
    host_bits = torch.zeros((args.constrained, (args.vocab + 31) // 32), dtype=torch.int32)
    finished = 0
    for step in range(args.warmup + args.steps):
        logits = torch.randn((args.batch, args.vocab), generator=generator, device=device, dtype=torch.float32)
        # The served path's host share (masked_sampling.py): the matchers fed their last tokens, then their
        # bitmasks filled into a host buffer; the graph applies them on the device with the sampler.
        start = time.perf_counter()
        masked, matchers, errors = book.prepare(seqs, rows)
        book.fill(matchers, host_bits[:len(matchers)])
        if step >= args.warmup:
            fill_times.append(time.perf_counter() - start)
        sync()
        start = time.perf_counter()
        errors += book.mask(logits, seqs, rows, to_device)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        if errors:
            raise RuntimeError(f"mask failed: {errors}")
        picked = logits[rows].argmax(dim=-1).tolist()
        for row, token in zip(rows, picked):
            if token == eos:  # its output is complete: a new request takes the row
                book.forget(seqs[row].seq_id)
                seqs[row] = admitted()
                finished += 1
            else:
                seqs[row].token_ids.append(token)
    ms = [t * 1000 for t in times]
    return {
        "mode": "mask_microbench", "device": str(device), "tokenizer_dir": str(tokenizer_dir), "vocab": args.vocab,
        "batch": args.batch, "constrained_rows": args.constrained, "warmup": args.warmup, "steps": args.steps,
        "fill_threads": book.threads, "mask_ms_p50": statistics.median(ms), "mask_ms_min": min(ms),
        "host_prepare_fill_ms_p50": 1000 * statistics.median(fill_times),
        "mask_ms_max": max(ms),
        "outputs_completed": finished, "sample_output": tokenizer.decode(seqs[rows[0]].token_ids[len(prompt):]),
        "schema": SCHEMA,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="qwen3-4b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--schema-fraction", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8, help="client processes the batch is spread over")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    parser.add_argument("--mask-microbench", action="store_true", help="time GrammarBook.mask alone (no server)")
    parser.add_argument("--tokenizer-dir", default=".bench-models/qwen3-4b-dummy")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--constrained", type=int, default=16, help="microbench: constrained rows of --batch")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if args.mask_microbench:
        result = mask_microbench(args)
        print(f"mask(): {result['constrained_rows']} of {result['batch']} rows constrained, vocab {result['vocab']}, "
              f"{result['device']}: p50 {result['mask_ms_p50']:.3f} ms/step (min {result['mask_ms_min']:.3f}, "
              f"max {result['mask_ms_max']:.3f}; {result['steps']} steps after {result['warmup']} warm-up; "
              f"{result['outputs_completed']} outputs completed; bitmask fill on {result['fill_threads']} threads); "
              f"the graph path's host share (matchers fed + bitmasks filled): p50 "
              f"{result['host_prepare_fill_ms_p50']:.3f} ms/step")
    else:
        result = server_bench(args)
        print_server_table(result)
    result["commit"] = commit()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
