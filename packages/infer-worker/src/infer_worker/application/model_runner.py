"""Runs one scheduled step: host bookkeeping in numpy -> one ragged forward -> logits of the sampling rows
-> logits processing (penalties, min_tokens, top logprobs, grammars; only when a row needs it, see
logits_processing.py and structured_output.py) -> sampler. `launch` only queues the work: the sampled ids come
back through an asynchronous device-to-host copy (`LaunchedStep.result()` waits for it), so the host can prepare
the next step while this one runs. A decode input that is still PENDING (sampled by the previous launch, not
collected yet) is gathered on the device from that launch's sampled-token tensor. The runner never mutates
sequences; the caller appends the sampled tokens and advances `num_computed`.

A hybrid model's linear-attention layers read each sequence's state slot (`Sequence.state_slot`); a sequence
whose step starts at position 0 (first admission, or recompute after preemption) starts from a zeroed slot.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence as Seq

import numpy as np
import torch

from infer_core.plan import blocks_needed
from infer_core.ports.backend import HostTransfer, LlmBackend
from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.sampler import SamplingBatch
from infer_protocol.messages import PromptLogprobs, SeqError
from infer_worker.application.block_table import BlockTable, ScheduledBatch, contiguous_start
from infer_worker.application.image_inputs import ImageInputs
from infer_worker.application.input_upload import InputUploader
from infer_worker.application.logits_processing import (ProcessingPlan, plan_processing, process_logits, raw_logprobs,
                                                        top_logprobs)
from infer_worker.application.prompt_logprobs import compute_prompt_logprobs, needs_prompt_logprobs
from infer_worker.application.sampled_tokens import SampledTokens
from infer_worker.application.structured_output import GrammarBook
from infer_worker.domain.sequence import GREEDY, PENDING, Sampling, ScheduledSeq, Sequence
from infer_worker.models.causal_lm import CausalLM, KvCaches

# The sampler's counter hash only reads the low 32 bits of a seed; masking here also keeps any Python int
# (the server may send up to 64-bit seeds) inside int64.
_SEED_MASK = 0xFFFFFFFF


def chunk_seqs(query_start_loc: np.ndarray) -> int:
    """How many sequences of a step bring two tokens or more (prompt chunks, not decodes)."""
    return int((np.diff(query_start_loc) > 1).sum())


class HostStep(NamedTuple):
    """A step's inputs as numpy arrays (the host side, before one device copy per field)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64, each token's rotary position (its index, shifted after a prompt with images)
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    # [B, max_blocks_per_seq] int32, -1 padded; a view of the persistent table when the step's slots are
    # contiguous, None when they are not (a gather of its rows is a copy that the graph runner, which gathers
    # them on the device, does not need): `host_block_tables()` gives it in every case.
    block_tables: np.ndarray | None
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    sample_rows: np.ndarray  # [N] int64, the last row of each sequence that samples
    sampling_seqs: list[Sequence]  # the N sequences that sample, in step order
    pending_pos: np.ndarray  # [P] int64, the rows of input_ids that are PENDING (gathered on the device)
    pending_rows: np.ndarray  # [P] int64, for each, its row in the sampled tokens of launch `pending_launch`
    pending_launch: int  # the launch those rows come from (-1 when P == 0)
    # The persistent table `block_tables` was taken from and each sequence's row of it (None: built from lists);
    # the graph runner keeps a device copy of that table and gathers the rows there instead of sending them.
    table: BlockTable | None = None
    slots: np.ndarray | None = None  # [B] int64
    max_blocks_per_seq: int = 0  # the block tables' width (the persistent table is wider only after an error)
    state_slots: np.ndarray | None = None  # [B] int32, each sequence's state slot (hybrid models)
    fresh_slots: np.ndarray | None = None  # [F] int32, the state slots of sequences that start at position 0

    def host_block_tables(self) -> np.ndarray:
        if self.block_tables is not None:
            return self.block_tables
        assert self.table is not None and self.slots is not None
        return self.table.rows(self.slots)[:, :self.max_blocks_per_seq]


def prepare_step(scheduled: Seq[ScheduledSeq], block_size: int, max_blocks_per_seq: int, *,
                 state_slots: bool = True, rope_deltas: bool = True) -> HostStep:
    """Vectorised bookkeeping: loops run per sequence (to read Python attributes), never per token in Python.
    `state_slots` / `rope_deltas`: read each sequence's state slot / image rotary shift (a runner whose model has
    no state layers / no vision tower skips those passes over the batch).

    Given a ScheduledBatch whose sequences all hold rows of its block table, the step's block-table rows come
    from it (`block_tables` is a view of it when the slots are contiguous, valid until the next plan is applied;
    None otherwise); else they are built from each sequence's `block_ids` list."""
    num_seqs = len(scheduled)
    starts = np.fromiter((s.seq.num_computed for s in scheduled), dtype=np.int64, count=num_seqs)
    num_new = np.fromiter((s.num_new for s in scheduled), dtype=np.int64, count=num_seqs)
    known = np.fromiter((s.seq.num_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    ends = starts + num_new
    bad = (num_new <= 0) | (starts < 0) | (ends > known)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"sequence {scheduled[i].seq.seq_id}: cannot compute {num_new[i]} tokens from {starts[i]} "
            f"with {known[i]} known tokens"
        )

    table = scheduled.table if isinstance(scheduled, ScheduledBatch) else None
    slots = np.fromiter((s.seq.slot for s in scheduled), dtype=np.int64, count=num_seqs) if table is not None else None
    if table is not None and slots is not None and (slots >= 0).all():
        # The persistent table: O(1) Python per sequence, and the step's rows are a view when its slots are
        # contiguous, else left in the table (pages below are read from it directly): flat in context.
        table.reserve(max_blocks_per_seq)
        num_blocks = table.num_blocks[slots]
    else:
        num_blocks = np.fromiter((len(s.seq.block_ids) for s in scheduled), dtype=np.int64, count=num_seqs)
        table, slots = None, None
    short = (num_blocks < -(-ends // block_size)) | (num_blocks > max_blocks_per_seq)
    if short.any():
        i = int(np.argmax(short))
        raise ValueError(
            f"sequence {scheduled[i].seq.seq_id} holds {num_blocks[i]} blocks; it needs "
            f"{blocks_needed(int(ends[i]), block_size)} for {ends[i]} tokens and may have at most {max_blocks_per_seq}"
        )
    block_tables: np.ndarray | None = None
    if table is None:
        block_tables = np.full((num_seqs, max_blocks_per_seq), -1, dtype=np.int32)
        for i, s in enumerate(scheduled):
            block_tables[i, : num_blocks[i]] = s.seq.block_ids
    elif (first := contiguous_start(slots)) is not None:
        # (the table is wider only if a sequence once held more blocks than allowed: those columns are dropped)
        block_tables = table.blocks[first:first + num_seqs, :max_blocks_per_seq]

    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    input_ids = np.fromiter(
        itertools.chain.from_iterable(s.seq.token_ids[s.seq.num_computed : s.seq.num_computed + s.num_new] for s in scheduled),
        dtype=np.int64,
        count=num_tokens,
    )
    seq_index = np.repeat(np.arange(num_seqs), num_new)
    # Each token's offset within its sequence's new tokens, shifted by where that sequence resumes.
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], num_new)
    if block_tables is not None:
        pages = block_tables[seq_index, positions // block_size].astype(np.int64)
    else:
        pages = table.blocks[slots[seq_index], positions // block_size].astype(np.int64)
    slot_mapping = pages * block_size + positions % block_size
    rotary = positions
    if rope_deltas:
        deltas = np.fromiter((s.seq.rope_delta for s in scheduled), dtype=np.int64, count=num_seqs)
        if deltas.any():  # tokens after a prompt with images rotate where its 3-D positions left off
            after = np.fromiter((s.seq.multimodal_until for s in scheduled), dtype=np.int64, count=num_seqs)
            rotary = positions + np.where(positions >= after[seq_index], deltas[seq_index], 0)

    slot_ids = (np.fromiter((s.seq.state_slot for s in scheduled), dtype=np.int32, count=num_seqs)
                if state_slots else None)
    samples = ends == known
    sampling_seqs = [s.seq for s, flag in zip(scheduled, samples) if flag]
    pending_pos = np.flatnonzero(input_ids == PENDING)
    pending_rows, pending_launch = _EMPTY, -1
    if pending_pos.size:
        owner_index = seq_index[pending_pos]
        owners = [scheduled[i].seq for i in owner_index.tolist()]
        launches = {seq.sampled_at for seq in owners}
        if len(launches) != 1 or bool((positions[pending_pos] != ends[owner_index] - 1).any()):
            raise ValueError(f"pending input tokens of launches {sorted(launches)} (only the last known token of a "
                             "sequence, sampled by one launch, may be pending)")
        pending_launch = launches.pop()
        pending_rows = np.fromiter((seq.sampled_row for seq in owners), dtype=np.int64, count=len(owners))
    return HostStep(
        input_ids=input_ids,
        positions=rotary,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=ends.astype(np.int32),
        block_tables=block_tables,
        max_query_len=int(num_new.max()),
        max_seq_len=int(ends.max()),
        is_decode=bool((num_new == 1).all()),
        sample_rows=query_start_loc[1:][samples] - 1,
        sampling_seqs=sampling_seqs,
        pending_pos=pending_pos,
        pending_rows=pending_rows,
        pending_launch=pending_launch,
        table=table,
        slots=slots,
        max_blocks_per_seq=max_blocks_per_seq,
        state_slots=slot_ids,
        fresh_slots=slot_ids[starts == 0] if slot_ids is not None else None,
    )


_EMPTY = np.zeros(0, dtype=np.int64)


def sampling_arrays(seqs: Seq[Sequence]) -> dict[str, np.ndarray]:
    """Per-row sampling parameters; the counter position is the index of the token being sampled."""
    params: list[Sampling] = [s.sampling for s in seqs]
    n = len(seqs)
    return {
        "temperature": np.fromiter((p.temperature for p in params), dtype=np.float32, count=n),
        "top_p": np.fromiter((p.top_p for p in params), dtype=np.float32, count=n),
        "top_k": np.fromiter((p.top_k for p in params), dtype=np.int32, count=n),
        "min_p": np.fromiter((p.min_p for p in params), dtype=np.float32, count=n),
        "seeds": np.fromiter((p.seed & _SEED_MASK for p in params), dtype=np.int64, count=n),
        "positions": np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=n),
    }


class LaunchedStep:
    """A step whose work is queued: its sampling sequences, and their sampled ids on the way to the host."""

    def __init__(self, launch_id: int, seqs: list[Sequence], transfer: HostTransfer | None = None,
                 done: SampledTokens | None = None) -> None:
        self.launch_id = launch_id  # rows of this launch's sampled tokens feed the next step's PENDING inputs
        self.seqs = seqs
        self._transfer = transfer
        self._done = done
        self.prompt_logprobs: list[PromptLogprobs] = []  # computed synchronously at launch (rare: see launch)
        self.seq_errors: list[SeqError] = []  # rows that failed on their own (a grammar that did not compile)

    def ready(self) -> bool:
        return self._done is not None or self._transfer is None or self._transfer.ready()

    def result(self) -> SampledTokens:
        if self._done is None:
            if self._transfer is None:
                self._done = SampledTokens([], [], [])
            else:
                tokens, logprobs = self._transfer.wait()
                self._done = SampledTokens([s.seq_id for s in self.seqs], tokens.tolist(), logprobs.tolist())
        if self.prompt_logprobs and not self._done.prompt_logprobs:
            self._done = self._done._replace(prompt_logprobs=self.prompt_logprobs)
        return self._done


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: LlmBackend,
        kv_caches: KvCaches,
        block_size: int,
        max_blocks_per_seq: int,
        device: str,
        state_pools: KvCaches = (),
    ) -> None:
        """`state_pools`: the linear-attention layers' slot pools among `kv_caches` (none for other models)."""
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.state_pools = list(state_pools)
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self._sampler = backend.ops.sampler
        self.num_launches = 0
        self._last_sampled: torch.Tensor | None = None  # the sampled ids of launch `num_launches` (device)
        self._last_launch: LaunchedStep | None = None  # launch `num_launches` (its ids on their way to the host)
        self._uploader = InputUploader(backend, device)
        # Grammars of structured outputs (shared with the worker service, which admits and forgets sequences);
        # without one a constrained row fails on its own.
        self.grammars: GrammarBook | None = None
        # The sequences' images (shared with the worker service likewise); None: the model has no vision tower.
        self.images: ImageInputs | None = None

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """One array to the device for the logits-processing path, without waiting for the device: a copy from
        pageable memory would synchronise the stream, so it goes through pinned memory (which torch's host
        allocator keeps until the copy is done)."""
        host = torch.from_numpy(array)
        if self.backend.host_memory:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _fill_pending(self, input_ids: torch.Tensor, step: HostStep, pending_pos: torch.Tensor,
                      pending_rows: torch.Tensor) -> None:
        """Gather the PENDING input ids on the device from the previous launch's sampled tokens."""
        if not step.pending_pos.size:
            return
        if step.pending_launch != self.num_launches or self._last_sampled is None:
            raise ValueError(f"pending input tokens of launch {step.pending_launch}, but the last launch that "
                             f"sampled is {self.num_launches}")
        input_ids[pending_pos] = self._last_sampled[pending_rows]

    def _launched(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor,
                  done: SampledTokens | None = None) -> LaunchedStep:
        self.num_launches += 1
        self._last_sampled = tokens
        if done is not None:
            self._last_launch = LaunchedStep(self.num_launches, seqs, done=done)
        else:
            self._last_launch = LaunchedStep(self.num_launches, seqs,
                                             transfer=self.backend.copy_to_host([tokens, logprobs]))
        return self._last_launch

    def _pending_token(self, seq: Sequence) -> int:
        """The id the previous launch sampled for `seq` (its PENDING last token). Called after this step's forward
        is queued, so the wait for that launch's copy overlaps this step's device work."""
        last = self._last_launch
        if last is None or seq.sampled_at != last.launch_id:
            raise ValueError(f"sequence {seq.seq_id}: its pending token is of launch {seq.sampled_at}, but the last "
                             f"launch that sampled is {self.num_launches}")
        return last.result().token_ids[seq.sampled_row]

    def _upload(self, step: HostStep, sampling: dict[str, np.ndarray]) -> tuple[list[torch.Tensor], AttentionBatch,
                                                                              SamplingBatch | None]:
        """Every input of the step in one copy: [input_ids, sample_rows, pending_pos, pending_rows] (+ [state_slots,
        fresh_slots] for a model with state layers), the attention batch and (when a row samples) the sampling
        batch."""
        attention = [step.positions, step.slot_mapping, step.query_start_loc, step.seq_lens, step.host_block_tables()]
        states = [step.state_slots, step.fresh_slots] if self.state_pools else []
        inputs = [step.input_ids, step.sample_rows, step.pending_pos, step.pending_rows, *states]
        dev = self._uploader.upload([*inputs, *attention, *sampling.values()])
        n = len(inputs)
        positions, slot_mapping, query_start_loc, seq_lens, block_tables = dev[n:n + 5]
        batch = AttentionBatch(positions=positions, slot_mapping=slot_mapping, query_start_loc=query_start_loc,
                               seq_lens=seq_lens, block_tables=block_tables, max_query_len=step.max_query_len,
                               max_seq_len=step.max_seq_len, is_decode=step.is_decode, block_size=self.block_size,
                               max_chunk_seqs=None if step.is_decode else chunk_seqs(step.query_start_loc))
        sampling_batch = None
        if sampling:
            sampling_batch = SamplingBatch(**dict(zip(sampling, dev[n + 5:])),
                                           all_greedy=bool((sampling["temperature"] == 0).all()))
        return dev[:n], batch, sampling_batch

    @property
    def eager_min_tokens(self) -> int:
        """The fewest tokens a mixed (prefill) step runs eagerly with: every step here."""
        return 1

    @property
    def graph_step_tokens(self) -> tuple[int, ...]:
        """The token buckets of the mixed-step graphs, to which a step is padded: none here."""
        return ()

    def execute(self, scheduled: Seq[ScheduledSeq]) -> SampledTokens:
        """Launch a step and wait for its tokens."""
        return self.launch(scheduled).result()

    @torch.inference_mode()
    def launch(self, scheduled: Seq[ScheduledSeq]) -> LaunchedStep:
        if not scheduled:
            return LaunchedStep(self.num_launches, [])
        trace = self.backend.trace_range
        with trace("prepare"):
            step = prepare_step(scheduled, self.block_size, self.max_blocks_per_seq,
                                state_slots=bool(self.state_pools), rope_deltas=self.images is not None)
            seqs = step.sampling_seqs
            inputs, batch, sampling = self._upload(step, sampling_arrays(seqs) if seqs else {})
            input_ids, sample_rows, pending_pos, pending_rows = inputs[:4]
            self._fill_pending(input_ids, step, pending_pos, pending_rows)
            state_slots = None
            if self.state_pools:
                state_slots, fresh_slots = inputs[4:]
                if step.fresh_slots is not None and step.fresh_slots.size:
                    self.backend.ops.gdn.reset_slots(self.state_pools, fresh_slots)  # type: ignore[union-attr]
        images = None
        if self.images is not None:
            with trace("vision"):  # the tower's time apart in a profile (it runs when a chunk first reaches an image)
                images = self.images.step(scheduled, step.query_start_loc)
        with trace("forward"):
            if images is None:
                hidden = self.model.forward(input_ids, batch, self.kv_caches, state_slots)
            else:
                hidden = self.model.forward(input_ids, batch, self.kv_caches, state_slots, images)
        prompt_lps = []
        if needs_prompt_logprobs(scheduled):  # waits for the forward: only requests that ask pay for it
            prompt_lps = compute_prompt_logprobs(scheduled, step.query_start_loc, hidden, self.model.compute_logits)
        if sampling is None:  # every sequence is mid-prefill: nothing to sample
            launched = LaunchedStep(self.num_launches, [])
        else:
            with trace("sample"):
                launched = self._sample(self.model.compute_logits(hidden[sample_rows]), seqs, sampling,
                                        plan_processing(seqs))
        launched.prompt_logprobs = prompt_lps
        return launched

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], sampling: SamplingBatch,
                plan: ProcessingPlan | None) -> LaunchedStep:
        """Sample the rows' logits (after logits processing when a row needs it: `plan`, plan_processing(seqs)) and
        launch the ids' way back."""
        if plan is None:  # the fast path: no penalties, no min_tokens mask, no top logprobs
            out = self._sampler.sample(logits, sampling)
            return self._launched(seqs, out.token_ids, out.logprobs)
        # Logits processing reads the rows' history (complete at launch: WorkerService.launch) and stays on the
        # device, so the step's tokens come back as the fast path's do; only top logprobs, returned as lists,
        # make it synchronous.
        processed = process_logits(logits, plan, self._tensor)
        errors: list[SeqError] = []
        if plan.grammar_rows:
            if self.grammars is None:
                errors = [SeqError(seqs[i].seq_id, "structured_output_unavailable",
                                   "this worker has no grammar engine", 500) for i in plan.grammar_rows]
            else:
                errors = self.grammars.mask(processed, seqs, plan.grammar_rows, self._tensor, self._pending_token)
        out = self._sampler.sample(processed, sampling)
        logprobs = raw_logprobs(logits, out.token_ids, out.logprobs, plan, self._tensor)
        if not plan.top_counts:
            launched = self._launched(seqs, out.token_ids, logprobs)
        else:
            done = SampledTokens(seq_ids=[s.seq_id for s in seqs], token_ids=out.token_ids.tolist(),
                                 logprobs=logprobs.tolist(), top_logprobs=top_logprobs(logits, plan, len(seqs),
                                                                                       self._tensor))
            launched = self._launched(seqs, out.token_ids, logprobs, done)
        launched.seq_errors = errors
        return launched

    def dummy_run(self, num_tokens: int, num_seqs: int = 1) -> SampledTokens:
        """A greedy prefill of `num_tokens` tokens split over `num_seqs` sequences through the real path (for
        warm-up and start-up checks). It writes KV into the first blocks of the cache: call it only while no
        sequence holds KV."""
        vocab = self.model.spec.vocab_size
        lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        paged = [cache for cache in self.kv_caches if all(cache is not pool for pool in self.state_pools)]
        cache_blocks = int(paged[0][0].shape[0])
        scheduled, next_block = [], 0
        for i, length in enumerate(lengths):
            if length == 0:
                continue
            blocks = blocks_needed(length, self.block_size)
            if next_block + blocks > cache_blocks:
                raise ValueError(f"dummy run of {num_tokens} tokens needs more than the {cache_blocks} cache blocks")
            token_ids = [(7 * (i + j) + 1) % vocab for j in range(length)]
            seq = Sequence(-1 - i, token_ids, 0, list(range(next_block, next_block + blocks)), GREEDY)
            scheduled.append(ScheduledSeq(seq, length))
            next_block += blocks
        return self.execute(scheduled)
