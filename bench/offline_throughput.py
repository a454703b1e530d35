"""Offline throughput through the served engine (nano-vllm's workload): N sequences with input and output
lengths uniform in [min_len, max_len], all submitted at once, ignore_eos; output tokens / wall time.

`--clients N` submits from N processes: one Python client with hundreds of connections is CPU-bound (httpx's pool
scans its connections on every request and close) and sets the pace itself. `--timeline` streams the answers and
reports where the wall time went: when the first and the last sequence got their first token (the prompts' share),
and each sequence's mean gap between tokens after its first (the decode steps at the batch the run reached).

    python bench/offline_throughput.py --url http://127.0.0.1:8000 --model qwen3-4b --num-seqs 256
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ holds host_budget, also when loaded by path
from client_processes import load_client, run_in_processes, start_time  # noqa: E402
from host_budget import HostBudget  # noqa: E402
from sse_tokens import token_text  # noqa: E402


Job = tuple[list[int], int]  # (prompt token ids, output tokens)
Mark = tuple[float, float, int]  # a streamed sequence's (first token, last token, token chunks), seconds from start


def make_jobs(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int, fixed_in: int | None,
              fixed_out: int | None) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(num_seqs):
        n_in = fixed_in or rng.randint(min_len, max_len)
        n_out = fixed_out or rng.randint(min_len, max_len)
        jobs.append(([rng.randrange(100, vocab) for _ in range(n_in)], n_out))
    return jobs


async def drive(url: str, model: str, jobs: list[Job], timeline: bool,
                start_at: float) -> tuple[list[int], list[Mark], float, float]:
    """Submits every job at wall-clock time `start_at`: (output tokens a job, the streamed marks, the wall-clock time
    the jobs were submitted, the time the last one ended)."""
    marks: list[Mark] = []
    async with load_client(url) as client:

        async def one(prompt: list[int], n_out: int) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True}
            if not timeline:
                resp = await client.post(f"{url}/v1/completions", json=body)
                resp.raise_for_status()
                return int(resp.json()["usage"]["completion_tokens"])
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            first = last = 0.0
            chunks = tokens = 0
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = int(event["usage"]["completion_tokens"])
                    if token_text(event) is not None:
                        last = time.time() - start_at
                        first = first or last
                        chunks += 1
            marks.append((first, last, chunks))
            return tokens

        await asyncio.sleep(max(0.0, start_at - time.time()))
        submitted = time.time()
        outputs = await asyncio.gather(*(one(p, n) for p, n in jobs))
    return list(outputs), marks, submitted, time.time()


def _client_process(url: str, model: str, jobs: list[Job], timeline: bool,
                    start_at: float) -> tuple[list[int], list[Mark], float, float]:
    return asyncio.run(drive(url, model, jobs, timeline, start_at))


async def run(url: str, model: str, jobs: list[Job], host_budget: bool = False, timeline: bool = False,
              clients: int = 1) -> dict:
    """All jobs at once; with `clients` > 1 from that many processes (every `clients`-th job each, started together),
    so that one Python client process, busy with hundreds of connections, does not set the pace."""
    budget = HostBudget(url) if host_budget else contextlib.nullcontext()
    async with budget:
        start_at = start_time(clients)
        if clients == 1:
            parts = [await drive(url, model, jobs, timeline, start_at)]
        else:  # a thread waits on the processes: the host budget's polling goes on meanwhile
            parts = await asyncio.to_thread(run_in_processes, _client_process, [
                (url, model, jobs[i::clients], timeline, start_at) for i in range(clients)])
    wall = max(end for *_, end in parts) - start_at
    output_tokens = sum(sum(outputs) for outputs, *_ in parts)
    total_in = sum(len(p) for p, _ in jobs)
    # how late the last client process submitted (a late one stretches the wall: it should be ~0)
    late = max(submitted for *_, submitted, _ in parts) - start_at
    return {"num_seqs": len(jobs), "clients": clients, "wall_s": wall, "late_start_s": late, "input_tokens": total_in,
            "output_tokens": output_tokens, "output_tok_per_s": output_tokens / wall,
            "total_tok_per_s": (output_tokens + total_in) / wall} | (
        {"host_budget": budget.report} if isinstance(budget, HostBudget) else {}) | (
        {"timeline": describe_timeline([m for _, marks, *_ in parts for m in marks], wall)} if timeline else {})


def describe_timeline(marks: list[Mark], wall: float) -> dict:
    """Where a streamed run's wall time went, from each sequence's (first token, last token, token chunks)."""
    firsts = sorted(m[0] for m in marks)
    gaps = sorted((last - first) / (chunks - 1) * 1e3 for first, last, chunks in marks if chunks > 1)
    decode = {f"p{p}": gaps[len(gaps) * p // 100] for p in (10, 50, 90)} if gaps else {}
    return {"first_token_s": {"min": firsts[0], "p50": firsts[len(firsts) // 2], "max": firsts[-1]},
            "last_token_s": max(m[1] for m in marks), "wall_s": wall, "decode_gap_ms": decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, help="fixed input length (e.g. 512 for the HF peer's workload)")
    ap.add_argument("--output-len", type=int, help="fixed output length (e.g. 256)")
    ap.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("offline_throughput.json"))
    ap.add_argument("--warmup-seqs", type=int, default=64,
                    help="a first, unrecorded pass of this many sequences (same lengths, 4 output tokens), so that "
                         "kernels first met by these step shapes compile outside the timed run (0: none)")
    ap.add_argument("--host-budget", action="store_true",
                    help="also measure each process's CPU time per step (the engine must run on this machine)")
    ap.add_argument("--timeline", action="store_true", help="stream the answers and report where the time went")
    ap.add_argument("--clients", type=int, default=1, help="client processes sharing the sequences (one Python "
                    "process handling hundreds of connections can be the slowest part)")
    args = ap.parse_args()
    if args.warmup_seqs:
        warm_jobs = make_jobs(min(args.warmup_seqs, args.num_seqs), args.min_len, args.max_len, args.vocab,
                              args.seed + 1, args.input_len, 4)
        warm = asyncio.run(run(args.url, args.model, warm_jobs))
        print(f"warm-up: {warm['num_seqs']} sequences in {warm['wall_s']:.2f} s", file=sys.stderr)
    jobs = make_jobs(args.num_seqs, args.min_len, args.max_len, args.vocab, args.seed, args.input_len, args.output_len)
    result = asyncio.run(run(args.url, args.model, jobs, args.host_budget, args.timeline, args.clients))
    print(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
