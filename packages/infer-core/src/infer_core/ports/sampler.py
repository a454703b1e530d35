"""Token sampling. Randomness is counter-based: each draw is a pure function of (seed, position), so a
seeded request yields the same tokens whatever else is batched with it, and no generator state lives on the
host (CUDA-graph friendly)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from infer_core.ports.tensor import Tensor


class SamplingBatch(NamedTuple):
    """Per-row sampling parameters as device tensors, one row per sequence that samples this step."""

    temperature: Tensor  # [N] float32; 0 = greedy
    top_p: Tensor  # [N] float32; 1 = off
    top_k: Tensor  # [N] int32; 0 = off
    min_p: Tensor  # [N] float32; 0 = off
    seeds: Tensor  # [N] int64
    positions: Tensor  # [N] int64, index of the token being sampled (the counter for the draw)
    all_greedy: bool  # lets the backend skip the stochastic path entirely


class SampleOutput(NamedTuple):
    token_ids: Tensor  # [N] int64
    logprobs: Tensor  # [N] float32, log-probability of the chosen token under the unmodified distribution


class Sampler(Protocol):
    def sample(self, logits: Tensor, batch: SamplingBatch) -> SampleOutput:
        """Pick one token per row of `logits` `[N, V]` (float32)."""
        ...
