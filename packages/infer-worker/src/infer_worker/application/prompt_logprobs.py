"""Prompt logprobs (OpenAI completions' `echo` with `logprobs`): for a sequence that asks, the logprob of each
prompt token after the first given the tokens before it, and its most likely alternatives — of the raw
distribution, from the hidden states of the prompt positions the step computes anyway.

Only steps that compute such positions pay for it: their rows' logits (`[rows, vocab]` float32) and one
log_softmax, in slices of `_ROWS_PER_SLICE` rows: no larger than the logits a full batch of `max_batch_seqs`
sampling rows takes, so a long prompt needs no memory the KV sizing did not leave (the worst-case forward's
activations are freed by then). The graph runner sends those steps down the eager path, which keeps every
hidden row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq

import numpy as np
import torch

from infer_protocol.messages import PromptLogprobs
from infer_worker.domain.sequence import ScheduledSeq

_ROWS_PER_SLICE = 256


def prompt_span(item: ScheduledSeq) -> tuple[int, int] | None:
    """The positions `[first, end)` of this step whose next token is a prompt token, for a sequence that asked
    for prompt logprobs; None otherwise (or when the step computes none of them)."""
    seq = item.seq
    if not seq.sampling.prompt_logprobs:
        return None
    first, end = seq.num_computed, min(seq.num_computed + item.num_new, seq.prompt_len - 1)
    return (first, end) if first < end else None


def needs_prompt_logprobs(scheduled: Seq[ScheduledSeq]) -> bool:
    return any(prompt_span(item) is not None for item in scheduled)


def compute_prompt_logprobs(scheduled: Seq[ScheduledSeq], query_start_loc: np.ndarray, hidden: torch.Tensor,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[PromptLogprobs]:
    """`hidden`: the step's hidden states, one row per computed token, the sequences' rows from
    `query_start_loc`; `scheduled` in step order."""
    out = []
    for i, item in enumerate(scheduled):
        span = prompt_span(item)
        if span is None:
            continue
        first, end = span
        row0 = int(query_start_loc[i])
        targets = torch.tensor(item.seq.token_ids[first + 1:end + 1], dtype=torch.int64, device=hidden.device)
        k = item.seq.sampling.top_logprobs
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        for lo in range(0, end - first, _ROWS_PER_SLICE):
            hi = min(lo + _ROWS_PER_SLICE, end - first)
            lp = torch.log_softmax(compute_logits(hidden[row0 + lo:row0 + hi]).to(torch.float32), dim=-1)
            logprobs += lp.gather(1, targets[lo:hi, None]).squeeze(1).tolist()
            if k > 0:
                values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
                top += [list(zip(i_row, v_row)) for i_row, v_row in zip(ids.tolist(), values.tolist())]
            else:
                top += [[] for _ in range(hi - lo)]
        out.append(PromptLogprobs(seq_id=item.seq.seq_id, start=first + 1, logprobs=logprobs, top=top))
    return out
