"""Long prompts against a running server: each length once as token ids through /v1/completions (no tokenizer time),
streamed, while a background decode stream runs, then TTFT per length and whether the background stream survived.

    python bench/long_prompts.py --url http://127.0.0.1:8000 --model qwen3-4b --lengths 8191,8192,8193,9000,16384

Every request must succeed (exit 1 otherwise): prompts up to max_model_len - max_tokens must be served.
TTFT of a prompt alone (no background stream) is the 16k-prompt probe of docs/benchmarks.md: use --no-background.
Against this project's server each length also reports the server's mean TTFT split into the scheduler's queue and
prefill times (bench/request_phases.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ holds sse_tokens, also when loaded by path
import request_phases  # noqa: E402
from sse_tokens import token_text  # noqa: E402


def stream_completion(client: httpx.Client, url: str, body: dict) -> tuple[float, int, str]:
    """(TTFT seconds, completion tokens from the usage chunk, error or ''). The TTFT is the first token's chunk
    (`sse_tokens.token_text`: an empty one included)."""
    start = time.perf_counter()
    ttft, chunks, tokens = 0.0, 0, 0
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return 0.0, 0, f"HTTP {resp.status_code}: {resp.read().decode()[:200]}"
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return ttft, tokens, str(event["error"])[:200]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if token_text(event) is not None:
                chunks += 1
                if chunks == 1:
                    ttft = time.perf_counter() - start
    return ttft, tokens, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", default="3000,8191,8192,8193,9000,16384")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    parser.add_argument("--repeats", type=int, default=1, help="runs per length (the TTFT is their median)")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="each prompt extends the one before (a growing conversation: prefix-cache hits)")
    parser.add_argument("--no-background", action="store_true", help="no decode stream alongside")
    parser.add_argument("--background-tokens", type=int, default=20000, help="the decode stream's max_tokens")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args()
    rng = random.Random(0)
    client = httpx.Client(timeout=600)
    stop = threading.Event()
    background: dict[str, object] = {"chunks": 0, "error": ""}

    def decode_alongside() -> None:
        body = {"model": args.model, "prompt": [rng.randrange(args.vocab) for _ in range(64)], "max_tokens": args.background_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(timeout=600) as bg, bg.stream("POST", f"{args.url}/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        background["error"] = str(event["error"])[:200]
                        return
                    background["chunks"] = int(background["chunks"]) + 1  # type: ignore[call-overload]
            background["error"] = background["error"] or "the background stream ended early"

    thread = None
    if not args.no_background:
        thread = threading.Thread(target=decode_alongside, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while background["chunks"] == 0 and not background["error"] and time.monotonic() < deadline:
            time.sleep(0.05)
    results, failed = [], 0
    lengths = [int(x) for x in args.lengths.split(",")]
    base = [rng.randrange(args.vocab) for _ in range(max(lengths))]
    for length in lengths:
        ttfts, error = [], ""
        phases_before = request_phases.scrape(args.url)
        for _ in range(args.repeats):
            prompt = base[:length] if args.shared_prefix else [rng.randrange(args.vocab) for _ in range(length)]
            body = {"model": args.model, "prompt": prompt,
                    "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
            ttft, tokens, error = stream_completion(client, args.url, body)
            if error or tokens != args.max_tokens:
                error = error or f"{tokens} tokens of {args.max_tokens}"
                break
            ttfts.append(ttft)
        ttfts.sort()
        row = {"prompt_tokens": length, "ttft_s": ttfts[len(ttfts) // 2] if ttfts else None, "error": error}
        phases = request_phases.means_ms(phases_before, request_phases.scrape(args.url))
        if phases:
            row["server_phases_ms"] = phases
        failed += bool(error)
        results.append(row)
        print(f"{length:>7} tokens  TTFT {row['ttft_s'] or 0:8.3f} s  {error or 'ok'}", flush=True)
        if phases:
            print(f"               {request_phases.describe(phases)}", flush=True)
    stop.set()
    if thread is not None:
        alive = not background["error"]
        print(f"background decode stream: {background['chunks']} chunks, {background['error'] or 'alive'}")
        failed += not alive
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"results": results, "background": background}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
