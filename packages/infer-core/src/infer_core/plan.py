"""Plan value types shared by the scheduler and the worker (pure data, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


# A token id in a sequence's `token_ids` that a step in flight is sampling: the one-step-ahead pipeline plans (the
# scheduler) and launches (the worker) the next step before its real id is known. Never a vocabulary id.
PENDING = -1


def penalises_repeats(presence_penalty: float, frequency_penalty: float, repetition_penalty: float) -> bool:
    """Whether a request's penalties change its logits (each needs the counts of its own tokens so far).

    Such a request reads its own output: with the one-step-ahead pipeline the scheduler plans it only once its
    last token is back, and the worker never launches it with a PENDING token (the rule both sides apply, from
    the request's sampling values). A grammar's state reads the output too, but a constrained row rides every
    step: the worker advances its matcher by the previous step's token while the step's forward runs (a waiting
    row sampled every other step, which measured a TPOT twice the step's on the H200)."""
    return presence_penalty != 0.0 or frequency_penalty != 0.0 or repetition_penalty != 1.0


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token / stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away or the request was cancelled
    ERROR = "error"  # the engine could not serve it


@dataclass(frozen=True, slots=True)
class KvCacheShape:
    """Geometry of the paged KV cache the worker allocated."""

    num_blocks: int
    block_size: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks to hold `num_tokens` KV entries (ceil division)."""
    return -(-num_tokens // block_size)
