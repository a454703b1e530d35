"""The headline online benchmark: Poisson arrivals against a running OpenAI-compatible server.

Workloads (`--workload`): `chat`, short chats of 40-500 characters (the reference harness's); `long`, one user
message of about `--prompt-tokens` tokens (default 3,000) each; `shared-prefix`, one fixed system prompt of about
`--prompt-tokens` tokens (default 1,500) shared by every request, then a short chat question. Prompt sizes are
set in characters from the server's own /tokenize count of a sample (4 characters a token if it has none); the
result records the prompt tokens the server reported in `usage`. `--image-fraction` (e.g. 0.25) puts an image
(`--image-side` pixels square, a JPEG data URL, one of a few distinct ones) before the question of that fraction of
the requests, for a vision model; their TTFT is also reported apart (`ttft_image_ms`).
`--image-ttft N` replaces the sweep by N requests one at a time, each one distinct image and a short question
(after a warm-up): the image request's TTFT with nothing else running, as a median. `--prompt-ttft N` likewise
sends N distinct prompts of `--prompt-tokens` (default 16,384) random token ids through /v1/completions: a lone
long prompt's TTFT without tokenizer time (the 16k-token probe; `bench/long_prompts.py` serves prompts of several
lengths beside a decode stream).

Metrics use vLLM's definitions: TTFT = time to the first content chunk; ITL = gaps between successive content
chunks; TPOT = (E2E - TTFT) / (output tokens - 1); E2E = request latency. Reported as mean/p50/p90/p99 with
request and output-token throughput and failures, per QPS level, as JSON (plot with bench/plot_sweep.py). Against
this project's server a level also holds the server's mean TTFT split into the scheduler's queue and prefill times
(`server_phases_ms`, bench/request_phases.py).

    python bench/serve_sweep.py --url http://127.0.0.1:8000 --model NAME --qps 1,2,4,8,16,32 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import random
import statistics
import string
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ holds host_budget, also when loaded by path
from client_processes import load_client, run_in_processes, start_time  # noqa: E402
import itl_gaps  # noqa: E402
from host_budget import HostBudget, describe  # noqa: E402
import request_phases  # noqa: E402
from sse_tokens import token_text  # noqa: E402



@dataclass
class RequestRecord:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    prompt_tokens: int = 0
    image: bool = False  # the request carried an image
    text: str = ""  # the streamed content, joined
    finish_reason: str = ""
    sent: float = 0.0  # wall-clock send time (comparable across client processes)


def make_prompt(rng: random.Random, target: int = 0) -> str:
    """`target` characters of plain words (40-500 at random when 0, as the reference harness uses)."""
    target = target or rng.randint(40, 500)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < target:
        words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))))
    return " ".join(words)[:target]


@dataclass(frozen=True)
class Workload:
    """What each request says (picklable: client processes build their prompts from it)."""

    kind: str = "chat"
    prompt_chars: int = 0  # `long`: the user message; `shared-prefix`: the system prompt
    image_fraction: float = 0.0  # this share of the requests carries an image before its question
    image_side: int = 1024

    def messages(self, rng: random.Random) -> list[dict[str, Any]]:
        if self.kind == "long":
            jitter = rng.uniform(0.9, 1.1)  # lengths differ, as real prompts do
            messages = [{"role": "user", "content": make_prompt(rng, int(self.prompt_chars * jitter))}]
        else:
            messages = [{"role": "user", "content": make_prompt(rng)}]
            if self.kind == "shared-prefix":
                messages.insert(0, {"role": "system", "content": make_prompt(random.Random(12345), self.prompt_chars)})
        if self.image_fraction and rng.random() < self.image_fraction:
            url = rng.choice(image_data_urls(self.image_side))
            question = messages[-1]["content"]
            messages[-1]["content"] = [{"type": "image_url", "image_url": {"url": url}},
                                       {"type": "text", "text": question}]
        return messages


IMAGE_POOL = 8  # distinct images: repeats share their prefix-cache pages, as a popular image would


@functools.cache
def image_data_urls(side: int) -> tuple[str, ...]:
    """`IMAGE_POOL` distinct JPEG images of `side` x `side` (smooth colour gradients: small bodies, the token count
    of any image of that size), as data URLs."""
    from PIL import Image

    urls = []
    for i in range(IMAGE_POOL):
        rows = Image.linear_gradient("L").resize((side, side))
        cols = rows.transpose(Image.Transpose.ROTATE_90)
        tint = Image.new("L", (side, side), (37 * i) % 256)
        image = Image.merge("RGB", (rows, cols, tint))
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=85)
        urls.append("data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode())
    return tuple(urls)


WORKLOADS = {"chat": 0, "long": 3000, "shared-prefix": 1500}  # default prompt tokens


def chars_per_token(url: str, model: str) -> float:
    """From the server's /tokenize of a 4,000-character sample; 4.0 when it has no such endpoint."""
    sample = make_prompt(random.Random(7), 4000)
    try:
        resp = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": sample}, timeout=30)
        count = resp.json().get("count") or len(resp.json().get("tokens", []))
        return len(sample) / count if resp.status_code == 200 and count else 4.0
    except (httpx.HTTPError, ValueError):
        return 4.0


IGNORE_EOS = {"ignore_eos": True}  # the default extra body fields (`--no-ignore-eos` drops them: HF serve refuses it)


async def one_request(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, Any]],
                      max_tokens: int, extra: dict[str, object] | None = None,
                      prompt_ids: list[int] | None = None) -> RequestRecord:
    """One streamed chat completion of `messages`; with `prompt_ids`, a completion of those token ids instead
    (/v1/completions: no chat template, no tokenizer time)."""
    body = {
        "model": model, "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    } | ({"messages": messages} if prompt_ids is None else {"prompt": prompt_ids}) | (
        IGNORE_EOS if extra is None else extra)
    endpoint = "chat/completions" if prompt_ids is None else "completions"
    start = time.perf_counter()
    last = start
    rec = RequestRecord(ok=False, image=any(isinstance(m["content"], list) for m in messages), sent=time.time())
    try:
        async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage") and not chunk.get("choices"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                    rec.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    continue
                if "error" in chunk:
                    rec.error = str(chunk["error"])
                    return rec
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                content = token_text(chunk)
                if content is not None:
                    rec.text += content
                    now = time.perf_counter()
                    if rec.ttft == 0.0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
        rec.e2e = time.perf_counter() - start
        rec.ok = rec.output_tokens > 0
        if not rec.ok:
            rec.error = "no usage chunk"
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


async def drive(url: str, model: str, qps: float, duration: float, max_tokens: int, seed: int,
                start_at: float, extra: dict[str, object] | None = None,
                workload: Workload = Workload()) -> tuple[list[RequestRecord], float]:
    """Poisson arrivals at `qps` for `duration` seconds from wall-clock time `start_at`; the records and the wall
    time until the last request ended."""
    rng = random.Random(seed)
    async with load_client(url) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        tasks: list[asyncio.Task[RequestRecord]] = []
        start = time.perf_counter()
        # Poisson from the start: a first arrival at 0 in every client process sent them as one burst.
        next_at = rng.expovariate(qps)
        while next_at < duration:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, url, model, workload.messages(rng), max_tokens, extra)))
            next_at += rng.expovariate(qps)
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


def _client_process(url: str, model: str, qps: float, duration: float, max_tokens: int, seed: int,
                    start_at: float, extra: dict[str, object] | None,
                    workload: Workload) -> tuple[list[RequestRecord], float]:
    return asyncio.run(drive(url, model, qps, duration, max_tokens, seed, start_at, extra, workload))


async def run_level(url: str, model: str, qps: float, duration: float, max_tokens: int, seed: int,
                    host_budget: bool = False, clients: int = 1, extra: dict[str, object] | None = None,
                    workload: Workload = Workload(), timeline: bool = False) -> dict:
    """One QPS level. With `clients` > 1 the load comes from that many processes, each a Poisson stream of
    qps / clients (their sum is a Poisson stream of qps), so one Python client process never limits the server.
    With `timeline` the level also holds each request's send time and gaps, and the long gaps' causes
    (`itl_gaps.classify`)."""
    budget = HostBudget(url) if host_budget else contextlib.nullcontext()
    phases_before = await asyncio.to_thread(request_phases.scrape, url)
    async with budget:
        start_at = start_time(clients)
        if clients == 1:
            records, wall = await drive(url, model, qps, duration, max_tokens, seed, start_at, extra, workload)
        else:  # a thread waits on the processes: the host budget's polling goes on meanwhile
            parts = await asyncio.to_thread(run_in_processes, _client_process, [
                (url, model, qps / clients, duration, max_tokens, seed * 1000 + i, start_at, extra, workload)
                for i in range(clients)])
            records = [r for part, _ in parts for r in part]
            wall = max(w for _, w in parts)
    phases = request_phases.means_ms(phases_before, await asyncio.to_thread(request_phases.scrape, url))
    ok = [r for r in records if r.ok]
    ms = 1e3
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "qps": qps,
        "duration_s": duration,
        "wall_s": wall,
        "num_requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "request_throughput": len(ok) / wall,
        "output_throughput": sum(r.output_tokens for r in ok) / wall,
        "offered_output_throughput": qps * max_tokens,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else float("nan"),
        "ttft_ms": {k: v * ms for k, v in summarize([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * ms for k, v in summarize(tpot).items()},
        "itl_ms": {k: v * ms for k, v in summarize([g for r in ok for g in r.itl]).items()},
        "e2e_ms": {k: v * ms for k, v in summarize([r.e2e for r in ok]).items()},
    } | ({"server_phases_ms": phases} if phases else {}) | (
        {"host_budget": budget.report} if isinstance(budget, HostBudget) else {}) | _image_stats(records) | (
        _timelines(ok) if timeline else {})


def _timelines(ok: list[RequestRecord]) -> dict[str, object]:
    timelines = [itl_gaps.Timeline(sent=r.sent, ttft=r.ttft, itl=r.itl) for r in ok]
    return {"long_gaps": itl_gaps.classify(timelines), "timeline": [
        {"sent": t["sent"], "ttft": t["ttft"], "itl": [round(g, 6) for g in t["itl"]]} for t in timelines]}


def _image_stats(records: list[RequestRecord]) -> dict[str, object]:
    """The image requests' count and TTFT (nothing for a workload without images)."""
    with_image = [r for r in records if r.image]
    if not with_image:
        return {}
    ttft = summarize([r.ttft for r in with_image if r.ok])
    return {"image_requests": len(with_image), "ttft_image_ms": {k: v * 1e3 for k, v in ttft.items()}}


QUESTION = "What is in this picture? Answer in one sentence."


async def image_ttft(url: str, model: str, side: int, repeats: int, max_tokens: int) -> dict[str, object]:
    """`repeats` requests one after another, nothing else running, each one image of `side` pixels (a distinct one
    each time: a repeated image would hit the prefix cache) and a short question, after one warm-up request."""
    urls = image_data_urls(side)
    if repeats + 1 > len(urls):
        raise SystemExit(f"--image-ttft takes at most {len(urls) - 1} repeats (distinct images)")

    def messages(i: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": urls[i]}},
                                             {"type": "text", "text": QUESTION}]}]

    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        records = [await one_request(client, url, model, messages(i), max_tokens) for i in (-1, *range(repeats))]
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise SystemExit(f"image TTFT: {len(failed)} requests failed: {failed[:3]}")
    measured = records[1:]
    return {"image": f"{side}x{side}", "repeats": repeats, "prompt_tokens": measured[0].prompt_tokens,
            "ttft_ms": [round(r.ttft * 1e3, 2) for r in measured],
            "ttft_ms_median": round(statistics.median(r.ttft for r in measured) * 1e3, 2),
            "warmup_ttft_ms": round(records[0].ttft * 1e3, 2)}


async def prompt_ttft(url: str, model: str, tokens: int, repeats: int, max_tokens: int, vocab: int,
                      seed: int) -> dict[str, object]:
    """`repeats` prompts of `tokens` random token ids, one after another with nothing else running (each distinct: a
    repeat would hit the prefix cache), after one short warm-up request: the TTFT of a lone long prompt (issue 14's
    16k-token probe) without tokenizer time."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (16, *([tokens] * repeats))]
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        records = [await one_request(client, url, model, [], max_tokens, prompt_ids=p) for p in prompts]
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise SystemExit(f"prompt TTFT: {len(failed)} requests failed: {failed[:3]}")
    measured = records[1:]
    return {"prompt_ttft_tokens": tokens, "repeats": repeats, "prompt_tokens": measured[0].prompt_tokens,
            "ttft_ms": [round(r.ttft * 1e3, 2) for r in measured],
            "ttft_ms_median": round(statistics.median(r.ttft for r in measured) * 1e3, 2),
            "warmup_ttft_ms": round(records[0].ttft * 1e3, 2)}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


async def warm_up(url: str, model: str, n: int, extra: dict[str, object]) -> list[float]:
    """n short requests at once (each server process gets some); their TTFTs in ms. Raises if one fails."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        hello = [[{"role": "user", "content": f"Hello {i}"}] for i in range(n)]
        records = await asyncio.gather(*(one_request(client, url, model, messages, 8, extra) for messages in hello))
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise SystemExit(f"warm-up failed: {failed[:3]}")
    return [round(r.ttft * 1e3, 1) for r in records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--qps", default="1,2,4,8,16,32")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="rustinfer")
    ap.add_argument("--out", type=Path, default=Path("serve_sweep.json"))
    ap.add_argument("--commit", default="", help="the commit measured (default: git rev-parse of this checkout)")
    ap.add_argument("--host-budget", action="store_true",
                    help="also measure each process's CPU time per step (the engine must run on this machine)")
    ap.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for servers that refuse "
                    "it, e.g. HF transformers serve; a random model rarely stops early anyway)")
    ap.add_argument("--clients", type=int, default=1, help="client processes sharing the load (one Python "
                    "process streams ~10k chunks/s at most)")
    ap.add_argument("--timeline", action="store_true",
                    help="keep each request's send time and gaps in the JSON, and class the long gaps by cause "
                    "(bench/itl_gaps.py: beside another request's prefill, shared with other streams, alone)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    ap.add_argument("--image-fraction", type=float, default=0.0,
                    help="share of the requests with an image before the question (a vision model), e.g. 0.25")
    ap.add_argument("--image-side", type=int, default=1024, help="the images' side in pixels")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="long / shared-prefix: prompt (system prompt) size in tokens; 0 = the workload's default")
    ap.add_argument("--image-ttft", type=int, default=0, metavar="N",
                    help="instead of the sweep: the TTFT of one --image-side image plus a short question, N requests "
                    "one at a time after a warm-up (median)")
    ap.add_argument("--prompt-ttft", type=int, default=0, metavar="N",
                    help="instead of the sweep: the TTFT of one prompt of --prompt-tokens (default 16,384) random token "
                    "ids through /v1/completions, N requests one at a time after a warm-up (median)")
    ap.add_argument("--vocab", type=int, default=30000, help="--prompt-ttft draws its token ids below this")
    ap.add_argument("--warmup", type=int, default=8, metavar="N",
                    help="N concurrent short requests before the first level, reported apart (as vLLM's bench sends a "
                    "test request first): the first requests after start-up pay one-time costs (0: none)")
    args = ap.parse_args()
    if args.image_ttft or args.prompt_ttft:
        result = asyncio.run(
            image_ttft(args.url, args.model, args.image_side, args.image_ttft, args.max_tokens) if args.image_ttft
            else prompt_ttft(args.url, args.model, args.prompt_tokens or 16384, args.prompt_ttft, args.max_tokens,
                             args.vocab, args.seed))
        print(json.dumps(result), flush=True)
        args.out.write_text(json.dumps({"label": args.label, "commit": args.commit or commit(), "model": args.model}
                                       | result, indent=2))
        return
    tokens = args.prompt_tokens or WORKLOADS[args.workload]
    workload = Workload(args.workload, int(tokens * chars_per_token(args.url, args.model)) if tokens else 0,
                        args.image_fraction, args.image_side)
    warmup_ttft_ms = asyncio.run(warm_up(args.url, args.model, args.warmup,
                                                {} if args.no_ignore_eos else IGNORE_EOS)) if args.warmup else []
    if warmup_ttft_ms:
        print(f"warm-up: {len(warmup_ttft_ms)} requests, TTFT max {max(warmup_ttft_ms):.1f} ms", flush=True)
    levels = []
    for qps in (float(q) for q in args.qps.split(",")):
        level = asyncio.run(run_level(args.url, args.model, qps, args.duration, args.max_tokens, args.seed,
                                      args.host_budget, args.clients, {} if args.no_ignore_eos else IGNORE_EOS,
                                      workload, args.timeline))
        levels.append(level)
        print(f"qps {qps:>5}: ITL p50 {level['itl_ms']['p50']:.2f} p99 {level['itl_ms']['p99']:.2f} ms | "
              f"TPOT p50 {level['tpot_ms']['p50']:.2f} | TTFT p50 {level['ttft_ms']['p50']:.1f} "
              f"p99 {level['ttft_ms']['p99']:.1f} ms | out {level['output_throughput']:.0f} tok/s | "
              f"prompt {level['prompt_tokens_mean']:.0f} tok | "
              f"failed {level['failed']}", flush=True)
        if "ttft_image_ms" in level:
            print(f"           {level['image_requests']} with an image: TTFT p50 {level['ttft_image_ms']['p50']:.1f} "
                  f"p99 {level['ttft_image_ms']['p99']:.1f} ms", flush=True)
        if "server_phases_ms" in level:
            print(f"           {request_phases.describe(level['server_phases_ms'])}", flush=True)
        if "host_budget" in level:
            print(f"           {describe(level['host_budget'])}", flush=True)
        if "long_gaps" in level:
            print(f"           {itl_gaps.describe(level['long_gaps'])}", flush=True)
    args.out.write_text(json.dumps({"label": args.label, "commit": args.commit or commit(), "model": args.model,
                                    "max_tokens": args.max_tokens, "workload": args.workload,
                                    "prompt_tokens": tokens, "image_fraction": args.image_fraction,
                                    "image_side": args.image_side, "warmup_ttft_ms": warmup_ttft_ms,
                                    "levels": levels}, indent=2))


if __name__ == "__main__":
    main()
