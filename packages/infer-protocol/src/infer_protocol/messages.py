"""Every wire message, as msgspec Structs in tagged unions (msgpack on ZMQ).

`PROTOCOL_VERSION` travels in `Ping`/`Pong` (server <-> scheduler) and `Ready` (worker -> scheduler): a server is
not ready while the scheduler's `Pong` carries another version, and a scheduler treats a worker whose `Ready` does
as lost.
"""

from __future__ import annotations

import msgspec

from infer_core.plan import penalises_repeats

# Bumped whenever a message or its fields change: an older peer cannot decode a new tag or (forbid_unknown_fields)
# a new field.
# 1: the first protocol
# 2: penalties, min_tokens masking, top logprobs (SamplingParams, NewSeq, StepResult, TokenOutput)
# 3: the one-step-ahead pipeline's per-step host timings (StepResult.launch_ms, SchedulerStats step timings)
# 4: logit_bias, then allowed_token_ids (SamplingParams; the latter came without a bump of its own)
# 5: prompt logprobs (SamplingParams.prompt_logprobs, PromptLogprobs, TokenOutput / StepResult.prompt_logprobs)
# 6: StepFailed (a step that failed on the worker without harming it: its requests fail, the engine goes on)
# 7: SchedulerStats.worker_restarts (workers adopted after the first)
# 8: structured outputs (SamplingParams.structured, StructuredOutput; StepResult.seq_errors, SeqError)
# 9: state slots of hybrid models (NewSeq.state_slot, Ready.num_state_slots)
# 10: images (ImageInput; Submit.images, NewSeq.images, ModelInfo.images)
# 11: StructuredOutput kinds regex, grammar (EBNF) and structural_tag (structured_outputs, tool calls)
# 12: ImageInput carries uint8 patches and their value table (patches, value_table) instead of float32 pixel_values
# 13: grammar readiness (StepResult.grammars_ready, GrammarStatus): the scheduler holds a constrained sequence's first
#     sample until its grammar is compiled
# 14: TokenOutput.prefill_time (first scheduled step -> first output, with the queue time on a request's first output)
PROTOCOL_VERSION = 14


class _Msg(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True, array_like=False):
    pass


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A grammar the output must follow (OpenAI's response_format): the worker compiles it and masks each step's
    logits with it; the request ends when the grammar is complete (its next token can only be a stop token)."""

    # "json_object" (any JSON object), "json_schema" (`schema` holds the JSON Schema), "regex" (a regex),
    # "grammar" (EBNF, root rule `root`) or "structural_tag" (xgrammar's structural tag as JSON: forced tool calls)
    kind: str
    # the grammar as text; JSON canonical (sorted keys), so equal schemas share one compilation
    schema: str = ""


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int = 0  # the server always fills one in (random when the client gave none)
    logprobs: bool = False  # return the sampled token's logprob (of the raw distribution)
    top_logprobs: int = 0  # and this many most likely alternatives per token (needs logprobs)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: divides positive / multiplies negative logits of prompt+generated
    min_tokens: int = 0  # stop tokens are masked (-inf) until this many tokens are generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI: (token id, bias) added to the logits, ids ascending
    allowed_token_ids: tuple[int, ...] = ()  # vLLM: when given, every other token is masked (-inf); ascending
    prompt_logprobs: bool = False  # the logprob (and top_logprobs alternatives) of every prompt token after the first
    structured: StructuredOutput | None = None  # response_format: the output follows this grammar

    @property
    def reads_its_output(self) -> bool:
        """infer_core.plan.penalises_repeats: such a request waits for its token rather than stalling the batch's."""
        return penalises_repeats(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)


class ImageInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One image of a prompt, preprocessed by the server as the model's own image processor does: its flattened
    patches, and where its placeholder tokens lie in the prompt. The vision tower turns the patches into
    `num_tokens` embeddings that replace the placeholders' (the worker); the prefix cache keys those positions on
    `content_hash`, so equal placeholder ids never share KV across different images (the scheduler).

    The patches travel as the resized image's bytes (uint8, a quarter of float32) with the table that maps each byte
    of each channel to its rescaled and normalized float32: the worker looks them up on its device, which gives the
    processor's float32 patches bit for bit."""

    offset: int  # index in prompt_token_ids of the first placeholder token
    num_tokens: int  # contiguous placeholder tokens from offset: grid_t * grid_h * grid_w / merge_size**2
    grid_thw: tuple[int, int, int]  # the image's patch grid (temporal, height, width)
    # uint8, C order: shape[0] = t * h * w patches of shape[1] = C * T * P * P bytes, channel major (column j is
    # of channel j // (T * P * P))
    patches: bytes
    shape: tuple[int, int]
    value_table: bytes  # float32 [C, 256], C order: the value of byte b in channel c is value_table[c, b]
    content_hash: str  # hex digest of what determines the patch values (the resized image and the processor settings)


# ---------------------------------------------------------------- server <-> scheduler


class Submit(_Msg, tag="submit"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    images: list[ImageInput] = []  # in prompt order, placeholder spans disjoint


class Abort(_Msg, tag="abort"):
    request_id: str


class Ping(_Msg, tag="ping"):
    version: int = PROTOCOL_VERSION


class PromptLogprobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Logprobs of consecutive prompt tokens, of the raw distribution: `logprobs[i]` is that of the token at
    position `start + i` given the tokens before it (`start` >= 1), `top[i]` its most likely alternatives."""

    seq_id: int
    start: int
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


class TokenOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # infer_core.plan.FinishReason value when the request ended
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # per token of token_ids: the sampling.top_logprobs most likely (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # on a request's first output only: seconds from its arrival at the scheduler to its first scheduled step
    queue_time: float | None = None
    # on a request's first output only: seconds from its first scheduled step (planned) to this output, at the
    # scheduler: the steps ahead of it still in flight, its prefill steps and the result's way back
    prefill_time: float | None = None
    # on a request's first output only, when sampling.prompt_logprobs: prompt tokens 1.. (seq_id -1, start 1)
    prompt_logprobs: PromptLogprobs | None = None


class TokenBatch(_Msg, tag="token_batch"):
    step: int
    outputs: list[TokenOutput]


class RequestError(_Msg, tag="request_error"):
    request_id: str
    code: str  # e.g. "context_length_exceeded", "worker_lost", "invalid_request"
    message: str
    status: int = 400


class SchedulerStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    worker_restarts: int = 0  # workers adopted after the first (each a new, empty KV cache)
    # host time per step, moving averages over the recent steps (milliseconds)
    plan_ms: float = 0.0  # the scheduler planning a step
    apply_ms: float = 0.0  # the scheduler applying a step's result (stop rules, outputs)
    worker_launch_ms: float = 0.0  # the worker applying a plan, preparing inputs and queueing the step
    worker_step_ms: float = 0.0  # the worker from taking a plan to its result being ready (device time included)
    # plan pacing (plan_slack_ms): plans held until shortly before the running step's end, and of those the ones
    # still held when that step's result arrived (the device waited for them)
    plans_held: int = 0
    plans_held_past_step_end: int = 0


class ModelInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the worker learned about the model, forwarded by the scheduler to the servers."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    backend: str
    device: str
    dtype: str
    images: bool = False  # the worker runs the model's vision tower: the server may send it images


class Pong(_Msg, tag="pong"):
    ready: bool
    stats: SchedulerStats
    model: ModelInfo | None = None
    status: str = ""  # a human line about start-up progress or failure
    version: int = PROTOCOL_VERSION


ServerToScheduler = Submit | Abort | Ping
SchedulerToServer = TokenBatch | RequestError | Pong


# ---------------------------------------------------------------- scheduler <-> worker


class NewSeq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A sequence the worker has not seen (or must recompute after preemption)."""

    seq_id: int
    token_ids: list[int]  # all known tokens: prompt (+ tokens generated before a preemption)
    num_computed: int  # leading tokens whose KV is already in the cache (prefix-cache hit)
    num_tokens: int  # tokens to compute in this step
    block_ids: list[int]  # blocks covering the sequence so far
    sampling: SamplingParams
    num_generated: int = 0  # tokens at the end of token_ids that were sampled (for the sampling counter)
    # the ids sampling.min_tokens masks until that many tokens are generated (sent only when min_tokens > 0), and
    # the stop tokens that end a sampling.structured grammar (always sent with one)
    stop_token_ids: list[int] = []
    # the sequence's state slot (1..Ready.num_state_slots) for a hybrid model's linear-attention layers, which
    # the worker zeroes on admission; 0 (the worker's scratch slot) when the model has none
    state_slot: int = 0
    # the prompt's images (every NewSeq of the sequence carries them: a recompute after preemption needs them too)
    images: list[ImageInput] = []


class ContinueSeq(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A sequence the worker holds: compute `num_tokens` more (1 for a decode), append `new_block_ids`."""

    seq_id: int
    num_tokens: int
    new_block_ids: list[int] = []


class StepPlan(_Msg, tag="step_plan"):
    step: int
    new_seqs: list[NewSeq] = []
    continuing: list[ContinueSeq] = []
    finished: list[int] = []  # seq ids to forget (finished or aborted) before this step runs
    preempted: list[int] = []  # seq ids to forget because their blocks were taken


class Shutdown(_Msg, tag="shutdown"):
    reason: str = ""


class StepResult(_Msg, tag="step_result"):
    step: int
    seq_ids: list[int]  # the sequences that sampled a token this step, in plan order
    token_ids: list[int]
    logprobs: list[float] | None = None
    elapsed_ms: float = 0.0
    # per sampled token: the (token id, logprob) alternatives its sequence asked for ([] when it asked none);
    # None when no sequence of the step asked for any
    top_logprobs: list[list[tuple[int, float]]] | None = None
    launch_ms: float = 0.0  # the worker's host time to apply the plan, prepare the inputs and queue the step
    # prompt tokens computed this step by sequences with sampling.prompt_logprobs (any sequence of the step)
    prompt_logprobs: list[PromptLogprobs] = []
    seq_errors: list[SeqError] = []  # sequences of the step that failed on their own (see SeqError)
    # sequences whose grammar (sampling.structured) finished compiling since the worker last said so: the scheduler
    # lets them sample from then on (a grammar that failed to compile is in seq_errors instead)
    grammars_ready: list[int] = []


class SeqError(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One sequence of a step failed on its own (its grammar did not compile): its request fails, the rest of the
    step stands. Its token in that step, and in any step planned before the scheduler finished it, is void."""

    seq_id: int
    code: str  # "invalid_grammar" (a schema the grammar engine refuses), "grammar_too_complex" (past the deadline)
    message: str
    status: int = 400


class StepFailed(_Msg, tag="step_failed"):
    """Step `step` failed on the worker with a Python-level error (not a device fault, which ends the worker): no
    StepResult comes for it. The worker forgot `seq_ids` (every sequence of the step) and leaves them out of the
    results of the steps after it; the scheduler fails their requests and drops them from its later steps too."""

    step: int
    seq_ids: list[int]
    message: str


class GrammarStatus(_Msg, tag="grammar_status"):
    """Grammars that became ready, or failed, while no step was in flight (otherwise the next StepResult says so):
    the worker sends it unasked, so a constrained sequence held at its last prompt token (and nothing else to run)
    is released, or failed alone, without a step."""

    ready: list[int] = []  # seq ids whose grammar is compiled (see StepResult.grammars_ready)
    errors: list[SeqError] = []  # seq ids whose grammar failed: invalid, or not compiled by the deadline


class Ready(_Msg, tag="ready"):
    num_blocks: int
    block_size: int
    model: ModelInfo
    version: int = PROTOCOL_VERSION
    # state slots of a hybrid model's linear-attention layers (slot 0, the worker's scratch, not counted); 0 = the
    # model has none. The scheduler admits at most this many sequences at once and turns prefix caching off.
    num_state_slots: int = 0
    # The token buckets of the worker's CUDA graphs for mixed (prefill) steps, which pad a step to the next one up
    # (none: every mixed step runs eagerly). The scheduler fits capped prompt chunks to them (`FcfsPolicy`).
    graph_step_tokens: list[int] = []


class Progress(_Msg, tag="progress"):
    status: str  # start-up progress line ("loading weights 3/10", ...)


class Heartbeat(_Msg, tag="heartbeat"):
    pass


class WorkerError(_Msg, tag="worker_error"):
    fatal: bool
    message: str
    step: int = -1


SchedulerToWorker = StepPlan | Shutdown
WorkerToScheduler = StepResult | StepFailed | GrammarStatus | Ready | Progress | Heartbeat | WorkerError
