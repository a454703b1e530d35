"""Which host op of logits processing waits for a busy device (tests/gpu/test_logits_processing_cuda.py failed on the
H200 without naming one): the processing under a 0.5 s device sleep, its CPU ops ranked by their own host time."""

from __future__ import annotations

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from infer_worker.application.logits_processing import plan_processing, process_logits
from infer_worker.domain.sequence import Sampling, Sequence


def pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).pin_memory().to("cuda", non_blocking=True)


rows = [
    Sequence(0, [5, 6, 7], 2, [0], Sampling(temperature=0.0, min_tokens=4), prompt_len=2, stop_token_ids=(9,)),
    Sequence(1, [5, 6, 7], 2, [0], Sampling(temperature=0.0, allowed_token_ids=(3, 4, 9))),
    Sequence(2, [5, 6, 7], 2, [0], Sampling(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.2)),
]
plan = plan_processing(rows)
logits = torch.randn(3, 1000, device="cuda")
for _ in range(3):
    process_logits(logits, plan, pinned)
torch.cuda.synchronize()
torch.cuda._sleep(1_000_000_000)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    process_logits(logits, plan, pinned)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
