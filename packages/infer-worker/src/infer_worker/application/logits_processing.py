"""The logits-processing step between the model and the sampler, and the top-k logprobs of a step.

Backend-agnostic: plain torch ops on the device the logits live on. Per sampling row, in this order
(vLLM's semantics):
1. min_tokens: the row's stop ids (EOS + stop_token_ids, as the scheduler stops on them) get -inf while
   fewer than `min_tokens` tokens are generated.
2. logit_bias (OpenAI, [-100, 100] per token id): added to the token's logit; then allowed_token_ids (vLLM):
   every token outside the set gets -inf.
3. repetition_penalty (HF / vLLM, > 0, 1 = off): every token seen in the prompt or the output has its
   logit divided by the penalty when positive, multiplied by it otherwise.
4. frequency_penalty and presence_penalty (OpenAI, [-2, 2], 0 = off), over the generated tokens only:
   `logit -= frequency * count + presence * (count > 0)`.
5. a grammar (response_format, `grammar_rows`): every token its matcher refuses gets -inf (structured_output.py;
   the model runner applies it after the steps above, on the same float32 copy).
The sampler then applies temperature / top-k / top-p / min-p to the processed logits. Its draw stays a pure
function of (seed, position): penalties change the distribution, never the random numbers.

Logprobs are of the model's raw distribution (log_softmax of the unprocessed logits, vLLM's default): the
sampled token's logprob is recomputed from the raw logits for rows whose logits were changed, and the
`top_logprobs` most likely tokens come from the raw log_softmax too.

Nothing here runs unless some row needs it (`plan_processing` returns None): the fast path, CUDA-graph
replay included, is untouched. Token counts are built on the device with one scatter-add from the rows'
token ids (concatenated with numpy, only for the rows with penalties): a dense host bincount would be
O(rows x vocab) host memory and transfer per step (150 MB at Qwen3's vocabulary for 256 rows).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence as Seq
from typing import NamedTuple

import numpy as np
import torch

from infer_worker.domain.sequence import Sequence

ToDevice = Callable[[np.ndarray], torch.Tensor]


class Penalties(NamedTuple):
    rows: np.ndarray  # [R] int64, the rows of the step's logits that have a penalty
    presence: np.ndarray  # [R] float32
    frequency: np.ndarray  # [R] float32
    repetition: np.ndarray  # [R] float32
    out_rows: np.ndarray  # [G] int64, index into `rows` of each generated token
    out_ids: np.ndarray  # [G] int64, the generated tokens of those rows
    seen_rows: np.ndarray  # [P] int64, index into `rows` of each prompt token (rows with repetition != 1 only)
    seen_ids: np.ndarray  # [P] int64


class ProcessingPlan(NamedTuple):
    """Host-side description of what one step's logits need (built once per step, only when needed)."""

    penalties: Penalties | None
    mask_rows: np.ndarray  # [M] int64 } (row, token) pairs set to -inf (min_tokens)
    mask_ids: np.ndarray  # [M] int64 }
    bias_rows: np.ndarray  # [B] int64   } (row, token, bias) added to the logits (logit_bias)
    bias_ids: np.ndarray  # [B] int64    }
    bias_values: np.ndarray  # [B] float32 }
    allow_rows: np.ndarray  # [A] int64, the rows restricted to allowed tokens
    allowed_rows: np.ndarray  # [T] int64 } (index into allow_rows, token) pairs that stay
    allowed_ids: np.ndarray  # [T] int64  }
    top_rows: np.ndarray  # [K] int64, the rows that asked for top logprobs
    top_counts: list[int]  # [K] how many each asked for
    grammar_rows: list[int]  # the rows whose sampling.structured grammar masks their logits

    @property
    def modifies(self) -> bool:
        return self.penalties is not None or bool(self.grammar_rows) or any(
            len(r) for r in (self.mask_rows, self.bias_rows, self.allow_rows))

    @property
    def grammar_only(self) -> bool:
        """The only processing is grammar masks (a masked sampling graph serves the step: masked_sampling.py)."""
        return bool(self.grammar_rows) and self.penalties is None and not self.top_counts and not any(
            len(r) for r in (self.mask_rows, self.bias_rows, self.allow_rows))

    @property
    def modified_rows(self) -> np.ndarray:
        rows = [self.mask_rows, self.bias_rows, self.allow_rows, np.asarray(self.grammar_rows, dtype=np.int64)]
        if self.penalties is not None:
            rows.append(self.penalties.rows)
        return np.unique(np.concatenate(rows))


def _ids(lists: Seq[Seq[int]]) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(len(x) for x in lists))


def _owners(lists: Seq[Seq[int]]) -> np.ndarray:
    return np.repeat(np.arange(len(lists), dtype=np.int64), [len(x) for x in lists])


def plan_processing(seqs: Seq[Sequence]) -> ProcessingPlan | None:
    """What the step's sampling rows need before and after sampling; None when no row needs anything."""
    if not any(len(s.token_ids) < s.process_until for s in seqs):
        return None
    pen: list[int] = []
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    biased: list[int] = []
    restricted: list[int] = []
    top_rows: list[int] = []
    top_counts: list[int] = []
    grammar_rows: list[int] = []
    for i, s in enumerate(seqs):
        p = s.sampling
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0:
            pen.append(i)
        if p.min_tokens > 0 and s.stop_token_ids and len(s.token_ids) - s.prompt_len < p.min_tokens:
            mask_rows.extend([i] * len(s.stop_token_ids))
            mask_ids.extend(s.stop_token_ids)
        if p.logit_bias:
            biased.append(i)
        if p.allowed_token_ids:
            restricted.append(i)
        if p.logprobs and p.top_logprobs > 0:
            top_rows.append(i)
            top_counts.append(p.top_logprobs)
        if p.structured is not None:
            grammar_rows.append(i)
    penalties = None
    if pen:
        params = [seqs[i].sampling for i in pen]
        outputs = [seqs[i].token_ids[seqs[i].prompt_len:] for i in pen]
        prompts = [seqs[i].token_ids[: seqs[i].prompt_len] if params[j].repetition_penalty != 1.0 else []
                   for j, i in enumerate(pen)]
        penalties = Penalties(
            rows=np.asarray(pen, dtype=np.int64),
            presence=np.fromiter((p.presence_penalty for p in params), dtype=np.float32, count=len(pen)),
            frequency=np.fromiter((p.frequency_penalty for p in params), dtype=np.float32, count=len(pen)),
            repetition=np.fromiter((p.repetition_penalty for p in params), dtype=np.float32, count=len(pen)),
            out_rows=_owners(outputs),
            out_ids=_ids(outputs),
            seen_rows=_owners(prompts),
            seen_ids=_ids(prompts),
        )
    biases = [seqs[i].sampling.logit_bias for i in biased]
    bias_pairs = list(itertools.chain.from_iterable(biases))
    allowed = [seqs[i].sampling.allowed_token_ids for i in restricted]
    return ProcessingPlan(
        penalties=penalties,
        mask_rows=np.asarray(mask_rows, dtype=np.int64),
        mask_ids=np.asarray(mask_ids, dtype=np.int64),
        bias_rows=np.asarray(biased, dtype=np.int64)[_owners(biases)],
        bias_ids=np.asarray([token for token, _ in bias_pairs], dtype=np.int64),
        bias_values=np.asarray([bias for _, bias in bias_pairs], dtype=np.float32),
        allow_rows=np.asarray(restricted, dtype=np.int64),
        allowed_rows=_owners(allowed),
        allowed_ids=_ids(allowed),
        top_rows=np.asarray(top_rows, dtype=np.int64),
        top_counts=top_counts,
        grammar_rows=grammar_rows,
    )


def _in_vocab(rows: np.ndarray, ids: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    keep = (ids >= 0) & (ids < vocab)
    if keep.all():
        return rows, ids
    return rows[keep], ids[keep]


def _put(target: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], value: float | bool) -> None:
    """`target[index] = value` with the value made on the device: as a Python scalar it would travel by a blocking
    copy, which waits for every step queued before (on the H200 a step with a min_tokens row then took its whole
    device time to launch: 6.8 ms at batch 64, against 2.5 ms for a grammar row's)."""
    fill = torch.full((), value, dtype=target.dtype, device=target.device)
    target.index_put_(index, fill.expand(index[0].shape[0]))


def apply_penalties(logits: torch.Tensor, pen: Penalties, to_device: ToDevice) -> torch.Tensor:
    """`logits` `[N, V]` float32 with the penalties applied to `pen.rows` (in place; returns it)."""
    vocab = logits.shape[-1]
    rows = to_device(pen.rows)
    sub = logits.index_select(0, rows)
    counts = torch.zeros_like(sub)
    out_rows, out_ids = _in_vocab(pen.out_rows, pen.out_ids, vocab)
    if len(out_ids):
        counts.index_put_((to_device(out_rows), to_device(out_ids)), torch.ones((), dtype=sub.dtype,
                          device=sub.device).expand(len(out_ids)), accumulate=True)
    generated = counts > 0
    rep = to_device(pen.repetition)[:, None]
    if bool((pen.repetition != 1.0).any()):
        seen = generated.clone()
        seen_rows, seen_ids = _in_vocab(pen.seen_rows, pen.seen_ids, vocab)
        if len(seen_ids):
            _put(seen, (to_device(seen_rows), to_device(seen_ids)), True)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - to_device(pen.frequency)[:, None] * counts - to_device(pen.presence)[:, None] * generated
    logits.index_copy_(0, rows, sub)
    return logits


def process_logits(logits: torch.Tensor, plan: ProcessingPlan, to_device: ToDevice) -> torch.Tensor:
    """The logits the sampler should see: `logits` itself when nothing changes it, else a float32 copy."""
    if not plan.modifies:
        return logits
    out = logits.to(torch.float32, copy=True)  # (the grammar mask, applied after this, relies on the copy)
    if len(plan.mask_rows):
        rows, ids = _in_vocab(plan.mask_rows, plan.mask_ids, out.shape[-1])
        _put(out, (to_device(rows), to_device(ids)), float("-inf"))
    if len(plan.bias_rows):
        keep = (plan.bias_ids >= 0) & (plan.bias_ids < out.shape[-1])
        out.index_put_((to_device(plan.bias_rows[keep]), to_device(plan.bias_ids[keep])),
                       to_device(plan.bias_values[keep]), accumulate=True)
    if len(plan.allow_rows):
        rows, ids = _in_vocab(plan.allowed_rows, plan.allowed_ids, out.shape[-1])
        outside = torch.ones((len(plan.allow_rows), out.shape[-1]), dtype=torch.bool, device=out.device)
        _put(outside, (to_device(rows), to_device(ids)), False)
        allow_rows = to_device(plan.allow_rows)
        out.index_copy_(0, allow_rows, out.index_select(0, allow_rows).masked_fill(outside, float("-inf")))
    if plan.penalties is not None:
        apply_penalties(out, plan.penalties, to_device)
    return out


def raw_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, sampled_logprobs: torch.Tensor,
                 plan: ProcessingPlan, to_device: ToDevice) -> torch.Tensor:
    """The sampled tokens' logprobs under the raw distribution. The sampler computed them from the logits it
    saw, which are the processed ones for the modified rows: those rows are recomputed from `raw_logits`."""
    if not plan.modifies:
        return sampled_logprobs
    rows = to_device(plan.modified_rows)
    lp = torch.log_softmax(raw_logits.index_select(0, rows).to(torch.float32), dim=-1)
    chosen = lp.gather(1, token_ids.index_select(0, rows).to(torch.int64)[:, None]).squeeze(1)
    out = sampled_logprobs.to(torch.float32, copy=True)
    out.index_copy_(0, rows, chosen)
    return out


def top_logprobs(raw_logits: torch.Tensor, plan: ProcessingPlan, num_rows: int,
                 to_device: ToDevice) -> list[list[tuple[int, float]]] | None:
    """Per row, its `top_logprobs` most likely (token id, logprob) of the raw distribution, most likely first
    ([] for rows that asked none); None when no row asked."""
    if not plan.top_counts:
        return None
    k = min(max(plan.top_counts), raw_logits.shape[-1])
    lp = torch.log_softmax(raw_logits.index_select(0, to_device(plan.top_rows)).to(torch.float32), dim=-1)
    values, ids = lp.topk(k, dim=-1, sorted=True)
    out: list[list[tuple[int, float]]] = [[] for _ in range(num_rows)]
    for row, count, row_ids, row_values in zip(plan.top_rows.tolist(), plan.top_counts, ids.tolist(),
                                               values.tolist(), strict=True):
        out[row] = list(zip(row_ids[:count], row_values[:count]))
    return out
