"""One request's scheduler-side state and its state machine.

    WAITING --admit--> RUNNING --stop / length / abort--> FINISHED
       ^                  |
       +----preempt-------+      (PREEMPTED is the transient edge back to WAITING: blocks are dropped and
                                  every known token, prompt + generated, is recomputed on re-admission)

A request with a grammar is held while RUNNING (`awaits_grammar`): it computes every prompt token but the last until
the worker reports its grammar compiled, so its first sample never waits for a compilation (planner.py).

`token_ids` holds every known token (prompt + sampled), then `num_pending` placeholders (PENDING) for the tokens
that steps in flight are sampling: the one-step-ahead pipeline plans the next step as if each of them were known,
and the engine writes each one in place when its step's result arrives. `num_computed` counts the leading tokens
whose KV is (or, once the steps in flight complete, will be) in the cache; the tokens still to compute are
`token_ids[num_computed:]`. A step that reaches the end of `token_ids` samples one token. Prefill and decode are
the same thing seen from here: a decode is simply a request with one token left to compute.

**Images.** An image's placeholder tokens all carry the same token id, whatever the image: the KV they lead to
depends on the image. So the prefix cache keys a request on `cache_tokens`, where each image's placeholders are
replaced by an id derived from its content hash (negative: never a token id, nor PENDING). Two prompts with equal
text and different images part at the first page holding an image token; the same image in the same place shares.
"""

from __future__ import annotations

import math
from enum import Enum

from infer_core.plan import PENDING, FinishReason
from infer_protocol.messages import ContinueSeq, ImageInput, PromptLogprobs, SamplingParams, Submit


def image_key_id(content_hash: str) -> int:
    """The radix-key id of an image's placeholders: 60 bits of its content hash, as a negative int below PENDING."""
    return PENDING - 1 - int(content_hash[:15], 16)


def image_keyed(prompt: list[int], images: list[ImageInput]) -> list[int]:
    key = list(prompt)
    for image in images:
        key[image.offset:image.offset + image.num_tokens] = [image_key_id(image.content_hash)] * image.num_tokens
    return key


NO_STATE_SLOT = 0  # (the worker's scratch slot: never a request's own)


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class InvalidTransition(RuntimeError):
    """A state change the state machine does not allow (a scheduler bug, never a client error)."""


class Request:
    __slots__ = (
        "request_id", "seq_id", "token_ids", "num_prompt_tokens", "sampling", "max_tokens", "stop_token_ids",
        "min_tokens", "max_len", "min_len", "want_logprobs", "status", "num_computed", "block_ids", "cache_node",
        "cache_len", "num_cached_tokens", "num_preemptions", "scheduled_step", "on_worker", "finish_reason",
        "decode_msg", "num_pending", "prompt_lps", "prompt_top", "state_slot", "images", "key_prompt",
        "reads_output", "awaits_grammar",
    )

    def __init__(self, msg: Submit, seq_id: int, max_model_len: int) -> None:
        self.request_id = msg.request_id
        self.seq_id = seq_id
        self.token_ids: list[int] = list(msg.prompt_token_ids)
        self.num_prompt_tokens = p = len(msg.prompt_token_ids)
        self.sampling: SamplingParams = msg.sampling
        self.max_tokens = msg.max_tokens
        # Exactly the ids to stop on: the server adds the model's EOS ids unless the request (or the config) says
        # ignore_eos, so Submit.ignore_eos needs no handling here — and must not switch off the client's own ids.
        self.stop_token_ids: frozenset[int] = frozenset(msg.stop_token_ids)
        self.min_tokens = msg.min_tokens
        # What the stop rules read (they live in Engine._write_tokens, the scheduler's hot loop):
        self.max_len = min(p + msg.max_tokens, max_model_len)  # "length" once len(token_ids) reaches this
        self.min_len = p + msg.min_tokens  # stop tokens count once len(token_ids) is beyond this
        self.want_logprobs = msg.sampling.logprobs
        self.reads_output = msg.sampling.reads_its_output  # (planner.py: it skips a step while its token is in flight)
        # A grammar (sampling.structured: response_format, a forced tool call) compiles on the worker from the
        # sequence's admission: until the worker reports it ready (Engine.grammars_ready) the request may compute
        # every prompt token but the last, whose logits it would sample (planner.py). A one-token prompt has nothing
        # to compute before that token: it is not held (the worker waits for the grammar at its first sample).
        self.awaits_grammar = msg.sampling.structured is not None and p > 1
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.block_ids: list[int] = []
        self.state_slot = NO_STATE_SLOT  # its state slot while admitted (hybrid models; kv_manager.py)
        self.cache_node: object | None = None  # the radix node this request holds locked (None = none)
        self.cache_len = 0  # tokens covered by cache_node (the request's prefix already in the radix cache)
        self.num_cached_tokens = -1  # prefix-cache hit at the first admission (-1 = not admitted yet)
        self.num_preemptions = 0
        self.scheduled_step = -1  # the last step that scheduled this request
        self.on_worker = False  # the worker holds this seq_id in its persistent batch
        self.finish_reason: FinishReason | None = None
        # A decode that needs no new block is the same (frozen) message every step: built once.
        self.decode_msg = ContinueSeq(seq_id, 1)
        self.num_pending = 0  # trailing PENDING placeholders in token_ids
        # sampling.prompt_logprobs: those of prompt tokens 1.. as the worker computes them, until the first output
        # carries them (None: not asked, or sent). Until then no prefix-cache hit may skip a prompt token.
        self.prompt_lps: list[float] | None = [math.nan] * (p - 1) if msg.sampling.prompt_logprobs else None
        self.prompt_top: list[list[tuple[int, float]]] = [[] for _ in range(p - 1)] if self.prompt_lps else []
        self.images: list[ImageInput] = msg.images
        # the prompt as the prefix cache keys it (None: no images, the prompt itself)
        self.key_prompt: list[int] | None = image_keyed(msg.prompt_token_ids, msg.images) if msg.images else None

    # ------------------------------------------------------------------ prompt logprobs

    def absorb_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        if self.prompt_lps is None:
            return
        for i, (lp, top) in enumerate(zip(chunk.logprobs, chunk.top, strict=True)):
            index = chunk.start - 1 + i
            if 0 <= index < len(self.prompt_lps):
                self.prompt_lps[index] = lp
                self.prompt_top[index] = top

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs for the request's first output (None once sent or when not asked)."""
        if self.prompt_lps is None:
            return None
        out = PromptLogprobs(seq_id=-1, start=1, logprobs=self.prompt_lps, top=self.prompt_top)
        self.prompt_lps, self.prompt_top = None, []
        return out

    # ------------------------------------------------------------------ views

    @property
    def cache_tokens(self) -> list[int]:
        """`token_ids` as the prefix cache keys them: each image's placeholders replaced by its content's key."""
        if self.key_prompt is None:
            return self.token_ids
        return self.key_prompt + self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known(self) -> int:
        """Tokens whose ids are known (the placeholders of steps in flight excluded)."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_computable(self) -> int:
        """Tokens it may compute now: all it has left, but the last one while its grammar compiles."""
        return len(self.token_ids) - self.num_computed - self.awaits_grammar

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    # ------------------------------------------------------------------ transitions

    def admit(self) -> None:
        if self.status is not RequestStatus.WAITING:
            raise InvalidTransition(f"admit {self.request_id}: {self.status.value} -> running")
        self.status = RequestStatus.RUNNING

    def preempt(self) -> None:
        """RUNNING -> (PREEMPTED) -> WAITING: everything is recomputed on re-admission."""
        if self.status is not RequestStatus.RUNNING:
            raise InvalidTransition(f"preempt {self.request_id}: {self.status.value} -> waiting")
        self.status = RequestStatus.WAITING  # its PENDING tokens stay: their results still count
        self.num_computed = 0
        self.num_preemptions += 1
        self.scheduled_step = -1

    def finish(self, reason: FinishReason) -> None:
        if self.status is RequestStatus.FINISHED:
            raise InvalidTransition(f"finish {self.request_id}: already finished")
        self.drop_pending()
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def add_pending(self) -> int:
        """A step in flight samples this request's next token: a placeholder for it; returns its index."""
        self.token_ids.append(PENDING)
        self.num_pending += 1
        return len(self.token_ids) - 1

    def drop_pending(self) -> None:
        """Forget the tokens of steps in flight (the request ended: their results are discarded)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, seq={self.seq_id}, {self.status.value}, "
                f"tokens={len(self.token_ids)}, computed={self.num_computed}, blocks={len(self.block_ids)})")
