"""The worker's host time per decode step, without a GPU: decode the StepPlan bytes, apply the diff to the
persistent batch, prepare the inputs (numpy bookkeeping, sampling rows) and pack them into the CUDA-graph
runner's page-locked staging layout — everything `WorkerService.launch` does on the host before the replay —
then write the sampled ids back (`collect`). The device copy, the replay and the sampling are left out: the
runner's device buffers are on torch's "meta" device by default, so a device op costs its dispatch only (on the
H200 an asynchronous launch); `--device cpu` runs them as host copies, as this bench did before it had the option.

    uv run python bench/worker_host_step.py [--steps 2000] [--batches 1,64,256] [--context 1024,32768] [--repeats 3] \
        [--device meta|cpu] [--shuffled]

Prints median / p90 CPU milliseconds per step for each batch size and context (this thread's CPU time). With
several contexts, each (batch, context) runs `--repeats` times in one process, the contexts interleaved (so a
noisy neighbour on a shared VM hits them alike); a run's figure is its median step, the row's the median of its
runs, and the last line per batch is the ratio of the last context's median to the first's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from infer_backend_cpu import CpuBackend
from infer_protocol import codec
from infer_protocol.messages import ContinueSeq, NewSeq, SamplingParams, StepPlan
from infer_worker.application.graph_runner import _StaticBuffers
from infer_worker.application.model_runner import LaunchedStep, prepare_step, sampling_arrays
from infer_worker.application.sampled_tokens import SampledTokens
from infer_worker.application.worker_service import WorkerService
from infer_worker.domain.sequence import ScheduledSeq

BLOCK = 16


class HostOnlyExecutor:
    """The graph runner's host half: prepare_step + sampling rows + one staging pack, then fake sampled ids."""

    def __init__(self, max_batch: int, max_blocks: int, device: str) -> None:
        self.buf = _StaticBuffers(max_batch, max_batch, max_blocks, device, CpuBackend())
        self.max_blocks = max_blocks
        self.launches = 0

    def launch(self, scheduled: list[ScheduledSeq]) -> LaunchedStep:
        step = prepare_step(scheduled, BLOCK, self.max_blocks, state_slots=False, rope_deltas=False)  # dense
        arrays = sampling_arrays(step.sampling_seqs)
        n = len(scheduled)
        self.buf.load(step, arrays, n, n)
        self.launches += 1
        ids = [s.seq_id for s in step.sampling_seqs]
        return LaunchedStep(self.launches, step.sampling_seqs, done=SampledTokens(ids, [7] * len(ids), [0.0] * len(ids)))


def run(batch: int, steps: int, context: int, device: str = "meta", shuffled: bool = False) -> list[float]:
    max_blocks = -(-(context + steps + 1) // BLOCK)
    service = WorkerService(HostOnlyExecutor(batch, max_blocks, device))
    enc, dec = codec.scheduler_to_worker(), codec.scheduler_to_worker()
    greedy = SamplingParams(temperature=0.0)
    next_block = 0
    new_seqs = []
    for i in range(batch):
        blocks = list(range(next_block, next_block + max_blocks))
        next_block += max_blocks
        new_seqs.append(NewSeq(seq_id=i + 1, token_ids=[(7 * i + j) % 30000 + 1 for j in range(context)],
                               num_computed=context - 1, num_tokens=1, block_ids=blocks, sampling=greedy))
    service.launch(StepPlan(step=1, new_seqs=new_seqs))
    service.collect()
    order = list(range(batch))
    if shuffled:  # the sequences' rows of the persistent table are then not one slice (a gather instead)
        random.Random(0).shuffle(order)
    plan_bytes = [enc.encode(StepPlan(step=k, continuing=[ContinueSeq(i + 1, 1) for i in order]))
                  for k in range(2, steps + 2)]
    clock = time.thread_time
    times = []
    for data in plan_bytes:
        c0 = clock()
        plan = dec.decode(data)
        service.launch(plan)
        service.collect()
        times.append(clock() - c0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", default="1024", help="tokens each sequence holds (a comma-separated list)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (batch, context), interleaved")
    ap.add_argument("--shuffled", action="store_true", help="continue the sequences in a fixed random order")
    ap.add_argument("--device", default="meta", choices=["meta", "cpu"], help="where the runner's device buffers are")
    args = ap.parse_args()
    contexts = [int(c) for c in args.context.split(",")]
    torch.set_num_threads(1)
    print(f"worker host time per decode step (plan decode + launch host work + collect), contexts {contexts}, "
          f"{args.steps} steps, {args.repeats} runs each, device buffers on {args.device}"
          f"{', shuffled order' if args.shuffled else ''}, this thread's CPU time")
    for batch in (int(b) for b in args.batches.split(",")):
        medians: dict[int, list[float]] = {c: [] for c in contexts}
        p90s: dict[int, list[float]] = {c: [] for c in contexts}
        for _ in range(args.repeats):
            for context in contexts:
                ms = sorted(t * 1e3 for t in run(batch, args.steps, context, args.device, args.shuffled))
                medians[context].append(statistics.median(ms))
                p90s[context].append(ms[int(0.9 * (len(ms) - 1))])
        for context in contexts:
            runs = " ".join(f"{m:.3f}" for m in medians[context])
            print(f"batch {batch:4d} context {context:6d}: median {statistics.median(medians[context]):.3f} ms  "
                  f"p90 {statistics.median(p90s[context]):.3f} ms  (run medians {runs})")
        if len(contexts) > 1:
            ratio = statistics.median(medians[contexts[-1]]) / statistics.median(medians[contexts[0]])
            print(f"batch {batch:4d}: context {contexts[-1]} / {contexts[0]} = {ratio:.2f}x")


if __name__ == "__main__":
    main()
