"""The worker's view of one sequence in its persistent batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from infer_protocol.messages import SamplingParams


@dataclass(slots=True)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt + every token sampled so far
    num_computed: int  # leading tokens whose KV is in the cache
    block_ids: list[int]  # the pages holding this sequence's KV, in order
    sampling: SamplingParams

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step: compute `token_ids[num_computed : num_computed + num_new]`."""

    seq: Sequence
    num_new: int

    @property
    def samples(self) -> bool:
        """A sequence samples a token when this step reaches the end of its known tokens."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


class SampledTokens(NamedTuple):
    """The step's sampled tokens, in the order of the sampling sequences of the step."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
