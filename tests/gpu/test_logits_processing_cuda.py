"""On the GPU: logits processing queues its work without waiting for the device (the one-step-ahead pipeline
prepares the next step while this one runs). A masked index written from a Python scalar went to the device by a
blocking copy, which waited for every queued step: a min_tokens row made its step's launch take the step's whole
device time on the H200."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer_worker.application.logits_processing import plan_processing, process_logits
from infer_worker.domain.sequence import Sampling, Sequence

pytestmark = pytest.mark.gpu


def _pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).pin_memory().to("cuda", non_blocking=True)


def test_processing_rows_queue_their_work_behind_a_busy_device() -> None:
    vocab = 1000
    rows = [
        Sequence(0, [5, 6, 7], 2, [0], Sampling(temperature=0.0, min_tokens=4), prompt_len=2, stop_token_ids=(9,)),
        Sequence(1, [5, 6, 7], 2, [0], Sampling(temperature=0.0, allowed_token_ids=(3, 4, 9))),
        Sequence(2, [5, 6, 7], 2, [0], Sampling(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.2)),
    ]
    plan = plan_processing(rows)
    assert plan is not None
    logits = torch.randn(3, vocab, device="cuda")
    # Steady state, as in serving: the page-locked blocks of an earlier step are back in torch's host cache. A
    # first pin_memory of a size allocates them (cudaHostAlloc), which may wait for the device, and which torch's
    # sync debug mode does not report (the H200 run failed this test without the warm-up, naming no op).
    for _ in range(2):
        process_logits(logits, plan, _pinned)
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time queued ahead of the processing
    busy.record()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising op raises here, naming itself in the traceback
    try:
        out = process_logits(logits, plan, _pinned)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not busy.query(), "process_logits waited for the device"
    torch.cuda.synchronize()
    assert out[0, 9].item() == float("-inf")  # min_tokens holds the stop id back
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed == [3, 4, 9]
    assert torch.isfinite(out[2]).all()
