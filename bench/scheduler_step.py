"""Planning cost of one scheduling step (plan_step + apply_result) with 256 running sequences and a waiting queue.

    uv run python bench/scheduler_step.py [--steps 2000] [--running 256] [--waiting 64]

Two workloads on the pure engine (no I/O, no worker: the worker's StepResult is built outside the timed part):
  decode  256 sequences decoding (prompts 100..1024 tokens, nobody finishes within --steps <= 5000), 64 requests
          waiting behind the max_batch_seqs = 256 cap.
  churn   the same, but max_tokens uniform in [16, 256]: requests finish, waiting ones are admitted (radix match,
          chunked prefill riding along with the decodes, cache inserts), the queue is topped up to --waiting.
Prints median / p90 / mean milliseconds per step, as elapsed time and as this thread's CPU time (the latter is
less disturbed by other work on a busy machine). Target: < 0.5 ms per step on the 2-core dev machine.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from infer_protocol.messages import SamplingParams, StepResult, Submit

from infer_scheduler.engine import Engine
from infer_scheduler.service import GC_THRESHOLDS

SAMPLING = SamplingParams(temperature=0.0)


def _submit(rng: random.Random, i: int, max_tokens: int, shared: list[int]) -> Submit:
    n = rng.randint(100, 1024)
    head = shared[: rng.randint(0, len(shared))]
    prompt = head + [rng.randrange(1, 32000) for _ in range(max(1, n - len(head)))]
    return Submit(request_id=f"b{i}", prompt_token_ids=prompt, sampling=SAMPLING, max_tokens=max_tokens,
                  stop_token_ids=[2])


def _fake_result(engine: Engine, plan, rng: random.Random) -> StepResult:
    """What the worker would send: a token for every sequence the step samples (the engine's record of them)."""
    sched = engine._inflight[-1]
    assert sched.step == plan.step
    ids = [req.seq_id for req, _ in sched.samplers]
    toks = [rng.randrange(3, 32000) for _ in ids]  # never the stop token: requests end by max_tokens
    return StepResult(step=plan.step, seq_ids=ids, token_ids=toks)


def run(mode: str, steps: int, running: int, waiting: int, seed: int = 0,
        gc_on: bool = True) -> tuple[list[float], list[float]]:
    """Per-step (wall seconds, CPU seconds of this thread) of plan_step + apply_result."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 32000) for _ in range(256)]
    engine = Engine(num_blocks=131072, block_size=16, max_model_len=8192, max_batch_tokens=8192,
                    max_batch_seqs=running, chunked_prefill_size=8192)
    n = 0

    def max_tokens() -> int:
        return 6000 if mode == "decode" else rng.randint(16, 256)

    for _ in range(running + waiting):
        n += 1
        assert engine.submit(_submit(rng, n, max_tokens(), shared)) is None
    # warm up: admit everyone, run their prefills
    for _ in range(100):
        plan = engine.plan_step()
        engine.apply_result(_fake_result(engine, plan, rng))
        if len(engine.running) == running and all(r.num_remaining == 1 for r in engine.running):
            break
    assert len(engine.running) == running, len(engine.running)
    times: list[float] = []
    cpu: list[float] = []
    clock = time.thread_time
    gc.collect()
    gc.freeze()  # as the service does after start-up (infer_scheduler.service.tune_gc)
    gc.set_threshold(*GC_THRESHOLDS)
    if not gc_on:
        gc.disable()
    try:
        for _ in range(steps):
            c0, t0 = clock(), time.perf_counter()
            plan = engine.plan_step()
            t1, c1 = time.perf_counter(), clock()
            result = _fake_result(engine, plan, rng)
            c2, t2 = clock(), time.perf_counter()
            engine.apply_result(result)
            t3, c3 = time.perf_counter(), clock()
            times.append((t1 - t0) + (t3 - t2))
            cpu.append((c1 - c0) + (c3 - c2))
            while len(engine.waiting) < waiting:  # top the queue up (outside the timed part)
                n += 1
                engine.submit(_submit(rng, n, max_tokens(), shared))
    finally:
        gc.enable()
        gc.unfreeze()
    return times, cpu


def _summary(xs: list[float]) -> str:
    t = sorted(x * 1e3 for x in xs)
    p90 = t[int(0.9 * (len(t) - 1))]
    return f"median {statistics.median(t):.3f} ms  p90 {p90:.3f} ms  mean {statistics.fmean(t):.3f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=64)
    ap.add_argument("--no-gc", action="store_true", help="disable the garbage collector in the timed loop")
    args = ap.parse_args()
    print(f"one scheduling step (plan_step + apply_result), {args.running} running, {args.waiting} waiting, "
          f"{args.steps} steps; wall = elapsed time, cpu = this thread's CPU time (robust to a busy machine)")
    for mode in ("decode", "churn"):
        wall, cpu = run(mode, args.steps, args.running, args.waiting, gc_on=not args.no_gc)
        print(f"{mode:6s} wall: {_summary(wall)}")
        print(f"{mode:6s} cpu:  {_summary(cpu)}")


if __name__ == "__main__":
    main()
