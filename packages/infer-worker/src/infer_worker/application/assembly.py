"""Assembles a ready worker from a loaded model on a backend: KV cache size (configured, a byte budget on a host
device, else a memory profile of the worst-case step), the context limit the cache holds, the runner (CUDA graphs
when the backend captures them), a self-check through the real path, and the optional test-only fault injection.

Application work behind the ports alone: the infrastructure's bootstrap resolves the model directory, creates
the backend from the entry point group, loads the weights and hands them here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infer_core.dtypes import DType
from infer_core.plan import blocks_needed
from infer_core.ports.backend import LlmBackend
from infer_protocol.config import Config
from infer_protocol.messages import ModelInfo

from infer_worker.application.cache_layout import allocate_caches, state_geometry
from infer_worker.application.fault_injection import FAULT_ENV, with_fault_injection
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.image_embeddings import profile_tower
from infer_worker.application.image_inputs import ImageInputs
from infer_worker.application.kv_sizing import KvGeometry, blocks_for_budget, profiled_budget
from infer_worker.application.model_runner import ModelRunner
from infer_worker.application.structured_output import GrammarBook, TokenizerInfoFactory
from infer_worker.application.worker_service import WorkerService
from infer_worker.domain.sequence import GREEDY, ScheduledSeq, Sequence
from infer_worker.models.causal_lm import CausalLM
from infer_worker.models.spec import ModelSpec
from infer_worker.models.tensor_parallel import local_kv_heads

log = logging.getLogger("rustinfer.worker")

Progress = Callable[[str], None]
AgreeBlocks = Callable[[int], int]  # tensor parallelism: the fewest KV blocks any rank can hold


def _alone(num_blocks: int) -> int:
    return num_blocks


def _always_fatal(exc: BaseException) -> bool:
    # A rank that failed a step has left the others inside or behind a collective: the group cannot go on.
    return True


class StartupError(RuntimeError):
    """The worker cannot start; the message says why in one line."""


@dataclass(frozen=True)
class ReadyWorker:
    service: WorkerService
    num_blocks: int
    block_size: int
    model: ModelInfo
    num_state_slots: int = 0  # a hybrid model's state slots (1..n; 0 = the model has none)
    graph_step_tokens: tuple[int, ...] = ()  # the runner's mixed-step graph buckets (`Ready.graph_step_tokens`)


def _profile_sequences(num_tokens: int, max_model_len: int, block_size: int) -> list[ScheduledSeq]:
    """The worst-case step: `num_tokens` prompt tokens split into sequences no longer than the context limit."""
    scheduled, next_block = [], 0
    remaining, seq_id = num_tokens, 0
    while remaining > 0:
        length = min(remaining, max_model_len)
        blocks = math.ceil(length / block_size)
        seq = Sequence(seq_id, [seq_id % 7 + 1] * length, 0, list(range(next_block, next_block + blocks)), GREEDY)
        scheduled.append(ScheduledSeq(seq, length))
        next_block += blocks
        remaining -= length
        seq_id += 1
    return scheduled


def num_state_slots(config: Config, spec: ModelSpec) -> int:
    """One state slot per sequence the scheduler may run at once (0 for a model without state layers)."""
    return config.max_batch_seqs if spec.num_state_layers else 0


def state_bytes(config: Config, spec: ModelSpec, dtype: DType) -> int:
    """The state pools' bytes (every slot and the scratch slot), taken from the KV budget before the blocks."""
    geometry = state_geometry(spec, dtype)
    return 0 if geometry is None else (num_state_slots(config, spec) + 1) * geometry.bytes_per_slot


def choose_num_blocks(config: Config, backend: LlmBackend, model: CausalLM, dtype: DType, geometry: KvGeometry,
                      max_model_len: int, progress: Progress) -> int:
    if config.num_blocks:
        return config.num_blocks
    max_blocks_per_seq = math.ceil(max_model_len / config.block_size)
    useful = max_blocks_per_seq * config.max_batch_seqs
    states = state_bytes(config, model.spec, dtype)
    if backend.host_memory:
        return min(useful, blocks_for_budget(geometry, config.cpu_kv_cache_bytes, states))
    progress("profiling memory with a worst-case forward")
    return profile_num_blocks(config, backend, model, dtype, geometry, max_model_len, useful, states)


def profile_num_blocks(config: Config, backend: LlmBackend, model: CausalLM, dtype: DType, geometry: KvGeometry,
                       max_model_len: int, useful: int, states: int = 0) -> int:
    """Run the worst-case step on a scratch cache, then give the KV cache what the peak leaves of
    `mem_fraction_static` of the device."""
    tokens = min(config.max_batch_tokens, max_model_len * config.max_batch_seqs)
    scratch_blocks = math.ceil(tokens / config.block_size) + config.max_batch_seqs
    backend.reset_peak_memory()
    # (a hybrid model's profile sequences all run in the scratch state slot: what they compute is not read)
    caches = allocate_caches(backend, model.spec, scratch_blocks, config.block_size, dtype, 0, geometry.num_kv_heads)
    runner = ModelRunner(model, backend, caches.per_layer, config.block_size, scratch_blocks, backend.device,
                         state_pools=caches.state_pools)
    runner.execute(_profile_sequences(tokens, max_model_len, config.block_size))
    if model.visual is not None:  # a step's tower calls run before its text forward, freed before it starts
        profile_tower(model.visual, config.max_image_pixels)
    backend.synchronize()
    peak = backend.peak_memory_bytes()
    del runner, caches
    total = backend.memory_info().total_bytes
    budget = profiled_budget(total, config.mem_fraction_static, peak)
    num_blocks = min(useful, blocks_for_budget(geometry, budget, states))
    log.info("memory profile: total %.2f GiB, peak after worst-case forward %.2f GiB, KV budget %.2f GiB "
             "(state slots %.2f GiB) -> %d blocks", total / 2**30, peak / 2**30, budget / 2**30, states / 2**30,
             num_blocks)
    return num_blocks


def self_check(runner: ModelRunner, vocab_size: int, block_size: int) -> None:
    """A bounded prefill + decode through the real path; a broken backend or model fails here, not on a user."""
    prompt = [(7 * i + 1) % vocab_size for i in range(block_size + 3)]
    seq = Sequence(-1, prompt, 0, list(range(math.ceil((len(prompt) + 2) / block_size))), GREEDY)
    for num_new in (len(prompt), 1):
        out = runner.execute([ScheduledSeq(seq, num_new)])
        if len(out.token_ids) != 1 or not 0 <= out.token_ids[0] < vocab_size or not math.isfinite(out.logprobs[0]):
            raise StartupError(f"self-check failed: sampled {out.token_ids} with logprobs {out.logprobs}")
        seq.num_computed += num_new
        seq.token_ids.append(out.token_ids[0])


def warm_eager_prefill(runner: ModelRunner, sizes: list[int], vocab_size: int, block_size: int,
                       num_blocks: int) -> list[int]:
    """Eager prefill steps of each of `sizes` sequences (the backend's `eager_variant_batch_sizes`), so that the
    kernels' batch-size variants compile here rather than while serving, where a compile of seconds stalls every
    request: each step just over the token count the runner's mixed graphs cover (a hybrid model has none: 2 tokens a
    sequence), each sequence in blocks of its own (sizes the KV cache cannot hold are left out). With mixed graphs
    each size runs twice where the cache holds both: every query its share of the step, then one query of the whole
    step's length beside 2-token ones, so that kernels chosen by query length (the CUDA prefill attention: the Triton
    kernel for short queries, the warp-specialised one for long) compile at both. The sequences share the scratch
    state slot and write KV that the scheduler's blocks overwrite. Returns the sizes run."""

    def fits(lens: list[int]) -> bool:
        return sum(-(-n // block_size) for n in lens) <= num_blocks

    def run(lens: list[int]) -> None:
        seqs, first = [], 0
        for i, n in enumerate(lens):
            blocks = -(-n // block_size)
            seqs.append(Sequence(-2 - i, [(3 * i + 5 * j + 1) % vocab_size for j in range(n)], 0,
                                 list(range(first, first + blocks)), GREEDY))
            first += blocks
        runner.execute([ScheduledSeq(seq, n) for seq, n in zip(seqs, lens)])

    ran = []
    for size in sizes:
        per_seq = max(2, -(-runner.eager_min_tokens // size))
        if not fits([per_seq] * size):
            break
        run([per_seq] * size)
        long = [max(per_seq, runner.eager_min_tokens)] + [2] * (size - 1)
        if runner.eager_min_tokens > 2 and fits(long):
            run(long)
        ran.append(size)
    return ran


def context_limit(config: Config, spec: ModelSpec) -> int:
    """`max_model_len`, or the model's `max_position_embeddings` when it is 0 (auto). Beyond the model's positions
    the RoPE table has no rows (and the model was never trained there): refused."""
    if config.max_model_len > spec.max_position_embeddings:
        raise StartupError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                           f"{spec.max_position_embeddings}; lower --max-model-len / max_model_len")
    return config.max_model_len or spec.max_position_embeddings


def fit_context_to_cache(config: Config, max_model_len: int, num_blocks: int, progress: Progress) -> int:
    """The KV cache must hold one sequence of `max_model_len` tokens (else a request the scheduler accepts could
    never be scheduled). An explicit `max_model_len` that does not fit is refused, naming the fix (as vLLM does);
    the automatic one is lowered to what fits."""
    bs = config.block_size
    need = blocks_needed(max_model_len, bs)
    if need <= num_blocks:
        return max_model_len
    if config.max_model_len:
        raise StartupError(
            f"max_model_len {max_model_len} needs {need} KV blocks of {bs} tokens but the KV cache has only "
            f"{num_blocks} ({num_blocks * bs} tokens); lower max_model_len, or raise mem_fraction_static / "
            f"num_blocks / cpu_kv_cache_bytes")
    fitted = num_blocks * bs
    log.warning("max_model_len lowered from the model's %d to %d: the KV cache holds %d blocks of %d tokens",
                max_model_len, fitted, num_blocks, bs)
    progress(f"max_model_len {fitted} (what the KV cache of {num_blocks} blocks holds)")
    return fitted


def build_runner(config: Config, backend: LlmBackend, model: CausalLM, caches: list, max_model_len: int,
                 progress: Progress, state_pools: list | None = None) -> ModelRunner:
    """The graph runner when the backend captures graphs and the config wants them (graphs captured here), else
    the eager one. `state_pools`: a hybrid model's (its decode steps replay graphs, its mixed steps run eagerly)."""
    max_blocks_per_seq = math.ceil(max_model_len / config.block_size)
    sizes = [size for size in config.capture_sizes if size <= config.max_batch_seqs]
    pools = state_pools or []
    if not (backend.supports_graphs and config.enable_cuda_graphs and sizes):
        return ModelRunner(model, backend, caches, config.block_size, max_blocks_per_seq, backend.device,
                           state_pools=pools)
    tokens = [t for t in config.capture_tokens if t <= config.max_batch_tokens]
    runner = GraphModelRunner(model, backend, caches, config.block_size, max_blocks_per_seq, backend.device,
                              state_pools=pools, capture_sizes=sizes, capture_tokens=tokens,
                              mixed_chunk_seqs=config.mixed_graph_chunk_seqs)
    progress(f"capturing CUDA graphs for decode batch sizes {sizes} and mixed steps of up to "
             f"{max(tokens, default=0)} tokens")
    runner.capture()
    return runner


def assemble(config: Config, backend: LlmBackend, model: CausalLM, model_dir: Path, max_model_len: int,
             progress: Progress, fault: str | None = None, fault_kind: str | None = None,
             tokenizer_info: TokenizerInfoFactory | None = None,
             agree_blocks: AgreeBlocks | None = None) -> ReadyWorker:
    """The ready worker for `model` (loaded on `backend` in `backend.default_dtype()`); `max_model_len` is
    `context_limit`'s, and may be lowered to what the KV cache holds. `fault`, `fault_kind`: the test-only
    fault injection's environment values (`application/fault_injection.py`); `tokenizer_info`: xgrammar's view of
    the model's tokenizer, made on the first structured-output request (without it such requests fail alone);
    `agree_blocks`: under tensor parallelism every rank runs this in lockstep, its KV cache holding its own KV
    heads, and all of them take the smallest block count any rank can hold."""
    spec, dtype = model.spec, backend.default_dtype()
    world = backend.ops.collective.world_size
    kv_heads = local_kv_heads(spec, world)
    geometry = KvGeometry(spec.num_attention_layers, kv_heads, spec.head_dim, config.block_size, dtype.itemsize)
    num_blocks = choose_num_blocks(config, backend, model, dtype, geometry, max_model_len, progress)
    num_blocks = (agree_blocks or _alone)(num_blocks)
    if num_blocks * config.block_size < 2 * config.block_size:
        states = state_bytes(config, spec, dtype)
        hint = (f" (the state slots of max_batch_seqs = {config.max_batch_seqs} sequences take {states / 2**30:.2f} "
                f"GiB of the budget first: lower max_batch_seqs)" if states and not config.num_blocks else "")
        raise StartupError(f"KV cache too small: {num_blocks} blocks of {config.block_size} tokens{hint}")
    max_model_len = fit_context_to_cache(config, max_model_len, num_blocks, progress)
    slots = num_state_slots(config, spec)
    progress(f"allocating the KV cache: {num_blocks} blocks x {config.block_size} tokens"
             + (f", {slots} state slots" if slots else ""))
    caches = allocate_caches(backend, spec, num_blocks, config.block_size, dtype, slots, kv_heads)
    runner = build_runner(config, backend, model, caches.per_layer, max_model_len, progress, caches.state_pools)
    progress("self-check: prefill + decode")
    self_check(runner, spec.vocab_size, config.block_size)
    variant_sizes = backend.eager_variant_batch_sizes(config.max_batch_seqs)
    if variant_sizes:
        progress("compiling the eager prefill kernels' batch variants")
        warm_eager_prefill(runner, variant_sizes, spec.vocab_size, config.block_size, num_blocks)
    info = ModelInfo(
        model_dir=str(model_dir),
        max_model_len=max_model_len,
        vocab_size=spec.vocab_size,
        backend=backend.name,
        device=backend.device,
        dtype=dtype.value,
        images=model.visual is not None,  # the server accepts image parts only then
    )
    log.info("ready: %s, %d KV blocks x %d, %d state slots, max_model_len %d", info, num_blocks, config.block_size,
             slots, max_model_len)
    if fault:
        log.warning("test-only fault injection is on: a step fails when a prompt holds token %s (%s)", fault, FAULT_ENV)
    try:
        executor = with_fault_injection(runner, fault, fault_kind, backend.device)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    runner.grammars = GrammarBook(tokenizer_info, spec.vocab_size)
    if model.visual is not None:
        runner.images = ImageInputs(model.visual, multimodal_rope=bool(spec.mrope_section))
    is_fatal = backend.is_fatal_error if world == 1 else _always_fatal
    service = WorkerService(executor, is_fatal=is_fatal, grammars=runner.grammars, images=runner.images)
    backend.serving_started()  # nothing more compiles at start-up: from here a compile stalls running requests
    return ReadyWorker(service, num_blocks, config.block_size, info, slots, runner.graph_step_tokens)
