"""The worker's view of one sequence in its persistent batch.

The domain knows no wire format (a contract in .importlinter): the sampling options are its own value type,
converted from the protocol's `SamplingParams` once, when the application admits a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from infer_core.plan import penalises_repeats
from infer_core.plan import PENDING as PENDING  # re-exported to the application (it fills the ids in on collection)


@dataclass(frozen=True, slots=True)
class Grammar:
    """A grammar the output follows (the protocol's `StructuredOutput`): compiled and matched in the application
    (`application/structured_output.py`); the domain only carries it."""

    kind: str  # "json_object", "json_schema", "regex", "grammar" (EBNF) or "structural_tag"
    schema: str = ""  # the grammar's text (the JSON Schema, the regex, the EBNF, the structural tag's JSON)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a sequence samples: what the runner and the logits processing read (field for field the protocol's
    `SamplingParams`, so one conversion at admission covers it; see `infer_worker.application.worker_service`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    allowed_token_ids: tuple[int, ...] = ()  # ascending
    prompt_logprobs: bool = False
    structured: Grammar | None = None  # response_format (its rows always take the logits-processing path)


GREEDY = Sampling(temperature=0.0)  # the start-up checks' and warm-ups' sequences


@dataclass(slots=True)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt + every token sampled so far (the last one PENDING while its step is in flight)
    num_computed: int  # leading tokens whose KV is in the cache
    block_ids: list[int]  # the pages holding this sequence's KV, in order
    sampling: Sampling
    prompt_len: int = -1  # leading tokens of token_ids that are the prompt (-1: all given at construction)
    stop_token_ids: tuple[int, ...] = ()  # what sampling.min_tokens masks until that many tokens are out
    # Sequences with len(token_ids) below this need the logits-processing step (penalties, logit bias,
    # allowed tokens, min_tokens, top logprobs) before sampling; 0 for most, so the fast path costs one
    # comparison per row.
    process_until: int = 0
    # Where the PENDING token lives until collected: the runner launch that samples it and its row in that
    # launch's sampled-token tensor (the next step gathers its input id from there, on the device).
    sampled_at: int = -1
    sampled_row: int = -1
    # This sequence's row in the worker's persistent block table (application/block_table.py); -1: none, and
    # prepare_step then builds the step's table from block_ids (sequences made outside the worker service).
    slot: int = -1
    # The sequence's state slot of a hybrid model's linear-attention layers (scheduler-assigned, 1..); 0 is the
    # scratch slot, which sequences made outside the worker service (start-up runs) share.
    state_slot: int = 0
    # A prompt with images: its tokens below `multimodal_until` (the prompt) need the step's image inputs (the
    # tower's embeddings, 3-D positions: application/image_inputs.py); the tokens after it rotate at their index
    # plus `rope_delta` (where the prompt's 3-D positions left off). 0 and 0 for a text prompt.
    multimodal_until: int = 0
    rope_delta: int = 0
    # Its next sample reads its own tokens so far (penalties' counts), so none of them may still be PENDING when
    # its step launches (set from `sampling`; the scheduler's rule is `SamplingParams.reads_its_output`). A
    # grammar row's matcher takes its PENDING token from the previous launch instead (GrammarBook.mask).
    reads_output: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.token_ids)
        p = self.sampling
        penalised = penalises_repeats(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        self.reads_output = penalised
        if penalised or (p.logprobs and p.top_logprobs > 0) or p.logit_bias or p.allowed_token_ids:
            self.process_until = _FOREVER
        elif p.min_tokens > 0 and self.stop_token_ids:
            self.process_until = self.prompt_len + p.min_tokens
        if p.prompt_logprobs:  # (not processing proper: it keeps the prompt's steps off the graphs' fast checks)
            self.process_until = max(self.process_until, self.prompt_len + 1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def needs_processing(self) -> bool:
        """The next sample needs the logits-processing step (the fast path cannot serve it)."""
        return len(self.token_ids) < self.process_until


_FOREVER = 2**62


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step: compute `token_ids[num_computed : num_computed + num_new]`."""

    seq: Sequence
    num_new: int

    @property
    def samples(self) -> bool:
        """A sequence samples a token when this step reaches the end of its known tokens."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens
