"""Grammar rows sampled by a CUDA graph: the bitmask applied, the sampler and the raw logprobs in one replay.

A batch whose only logits processing is a grammar (response_format, forced tool calls) would otherwise run the
eager processing path after its graph: the float32 copy, the mask's unpack and apply, the sampler and the raw
logprobs, ~40 torch calls, ~1.2 ms of host a step on the H200 at batch 64, on top of the bitmask fill. Under the
one-step-ahead pipeline the host waits for the previous step's tokens before filling, so all of it must fit in
one device step: it made the structured batch host-bound (docs/benchmarks.md, sixth session). Here the host fills
the grammar rows' bitmasks into a page-locked slot, sends them with a per-row index in one copy, and replays one
graph per (capture size, greedy) that reads the logits the forward graph left in the static buffer.

Rows without a grammar (the all-set index) see every bit set, so their tokens are those of the unmasked logits; their
logprobs are the sampler's, and the grammar rows' are recomputed from the raw logits (vLLM's default: logprobs
of the model's distribution, as logits_processing.raw_logprobs gives on the eager path).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from infer_core.ports.backend import LlmBackend
from infer_core.ports.sampler import Sampler, SamplingBatch
from infer_worker.application.input_upload import StagingRing, aligned, device_views, host_views
from infer_worker.application.structured_output import bit_values, refused_tokens


class GrammarMasks:
    """The device buffers a masked sampling graph reads (`index [rows]` int64: each row's bitmask row, `rows`
    (the last, every bit set) for none; `bits [rows + 1, words]` int32, the grammar rows' bitmasks packed at the
    front) and their page-locked staging slots, used in turn and rewritten only once the device has read them.
    (A free row reads the all-set row rather than a `torch.where` against a 0-dim -1: captured in a CUDA graph
    that gave free rows all-zero words on the H200, every token refused.)"""

    def __init__(self, max_rows: int, vocab: int, device: str, backend: LlmBackend) -> None:
        self.words = (vocab + 31) // 32
        self.free_row = max_rows
        self._bits_offset = aligned(max_rows * 8)
        self._layout = [(0, np.dtype(np.int64), (max_rows,)),
                        (self._bits_offset, np.dtype(np.int32), (max_rows + 1, self.words))]
        num_bytes = self._bits_offset + (max_rows + 1) * self.words * 4
        self.region = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.index, self.bits = device_views(self.region, self._layout)
        self.index.fill_(self.free_row)
        self.bits[self.free_row].fill_(-1)  # (never copied over: an upload sends at most max_rows rows)
        self.bit_values = bit_values(device)
        self._ring = StagingRing(backend, num_bytes)

    def upload(self, size: int, rows: list[int], fill: Callable[[torch.Tensor], None]) -> None:
        """Rows `rows` (of the first `size`) take the bitmasks `fill` writes into its `[len(rows), words]` host
        tensor, in that order; the other rows none. One copy."""
        staging = self._ring.take(self.region.numel())
        index, bits = host_views(staging, self._layout)
        index[:size] = self.free_row
        index[rows] = np.arange(len(rows), dtype=np.int64)
        if rows:
            fill(torch.from_numpy(bits[:len(rows)]))
        end = self._bits_offset + len(rows) * self.words * 4
        self.region[:end].copy_(staging[:end], non_blocking=True)
        self._ring.copied()


def masked_sample_fn(masks: GrammarMasks, sampler: Sampler, logits: torch.Tensor, sampling: SamplingBatch,
                     out_tokens: torch.Tensor, out_logprobs: torch.Tensor) -> Callable[[], None]:
    """A step to capture: sample `logits` `[size, vocab]` (static, left unchanged) with every token its row's
    bitmask refuses at -inf, into `out_tokens` / `out_logprobs` `[size]`."""
    size = logits.shape[0]
    index = masks.index[:size]

    def step() -> None:
        constrained = index != masks.free_row
        words = masks.bits.index_select(0, index)
        masked = logits.masked_fill(refused_tokens(words, masks.bit_values, logits.shape[-1]), float("-inf"))
        out = sampler.sample(masked, sampling)
        chosen = logits.gather(1, out.token_ids.to(torch.int64)[:, None]).squeeze(1)
        raw = chosen - torch.logsumexp(logits, dim=-1)
        out_tokens.copy_(out.token_ids)
        out_logprobs.copy_(torch.where(constrained, raw, out.logprobs.to(torch.float32)))

    return step


def masked_sampling_enabled() -> bool:
    """`INFER_MASKED_SAMPLING=0` samples grammar rows eagerly after the graph (the A/B baseline)."""
    return os.environ.get("INFER_MASKED_SAMPLING", "1") != "0"
