"""CUDA graphs for decode and for mixed steps (nano-vllm style, over address-stable buffers).

Decode: one graph per capture size; a batch of one-token sequences is copied into the buffers, padded to the
next captured size (padding rows: slot -1, context 0, greedy) and replayed; attention, norms, RoPE, the KV store
and sampling all run inside the graph.

Mixed (prefill chunks with or without decodes): one graph per (token bucket T, sequence bucket S), S <= T. The
step's tokens are padded to T (slot -1: no KV write) and its sequences to S (empty query, context 0); the
prefill attention kernel's grid covers T query rows per sequence, and the rows a sequence does not own are
skipped. The graph ends at the logits of the sampling rows; sampling runs after the replay, so one graph serves
greedy and stochastic batches, and rows that need logits processing (penalties, min_tokens masking, top
logprobs, a grammar). Without these graphs such a step pays the eager launch cost of every layer.

Decode with logits processing: a decode batch with such a row replays a decode graph that stops at the logits
(one per capture size), then processes and samples them as a mixed step does: the rows keep the decode attention
path (a mixed graph would run them through the ragged kernels), and the grammar mask, which needs the token still
in flight, is filled while the forward runs.

PENDING input ids are gathered into the input buffer from the previous launch's sampled tokens just before a
replay. Larger steps run on the eager path of ModelRunner.

A hybrid model (linear-attention layers) replays decode graphs too: each row's state slot is a static input
(padding rows read and write scratch slot 0), and the slots of sequences that start at position 0 are zeroed
before the replay, outside the graph. Its mixed steps run eagerly: `GatedDeltaOps` promises graph-safe kernels
for decode steps only (`StateBatch.is_decode`)."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import torch

from infer_core.ports.backend import LlmBackend
from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.sampler import SamplingBatch

from infer_worker.application.block_table import BlockTable, contiguous_start
from infer_worker.application.input_upload import SLOTS, CopyFences, aligned, device_views, host_views
from infer_worker.application.logits_processing import plan_processing
from infer_worker.application.masked_sampling import GrammarMasks, masked_sample_fn, masked_sampling_enabled
from infer_worker.application.model_runner import HostStep, LaunchedStep, ModelRunner, prepare_step, sampling_arrays
from infer_worker.application.prompt_logprobs import needs_prompt_logprobs
from infer_worker.domain.sequence import ScheduledSeq

DECODE, DECODE_LOGITS, MIXED = "decode", "decode_logits", "mixed"  # which graph a step replays
log = logging.getLogger("rustinfer.worker")


# The uploaded inputs of a captured step: (name, dtype, value of a padding row), per token, per sequence, per
# sampling row. The sampling rows are a prefix of the sequences (those that sample, in step order).
_TOKEN_FIELDS: tuple[tuple[str, type, float], ...] = (
    ("input_ids", np.int64, 0), ("positions", np.int64, 0), ("slot_mapping", np.int64, -1))
_SEQ_FIELDS: tuple[tuple[str, type, float], ...] = (("seq_lens", np.int32, 0), ("state_slots", np.int32, 0))
_SAMPLE_FIELDS: tuple[tuple[str, type, float], ...] = (
    ("temperature", np.float32, 0), ("top_p", np.float32, 1), ("top_k", np.int32, 0), ("min_p", np.float32, 0),
    ("seeds", np.int64, 0), ("sample_positions", np.int64, 0), ("sample_rows", np.int64, 0))
# Also uploaded: the PENDING inputs' token rows and source rows (a prefix of them is used), query_start_loc
# (S + 1 entries; padding sequences are empty), and with a persistent block table the step's rows of it
# (`table_slots`) and the rows the device copy lacks (`stale_slots`, their contents where the block table goes);
# for a hybrid model the state slots to zero before the replay (`fresh_slots`, a prefix is used).
_OTHER_FIELDS: tuple[tuple[str, type], ...] = (
    ("pending_pos", np.int64), ("pending_rows", np.int64), ("query_start_loc", np.int32),
    ("table_slots", np.int64), ("stale_slots", np.int64), ("fresh_slots", np.int32))


class _DeviceBlockTable:
    """A device copy of the worker's persistent block table (BlockTable), one row per slot plus a last row of
    zeros for padding sequences. A step sends only its rows that changed since the copy last saw them (at
    batch 256 decode, ~1/16 of the rows: those that got a block) and gathers its rows on the device, instead of
    packing and sending [B, max_blocks_per_seq] every step (2.2 MB at 32k tokens of context)."""

    def __init__(self, width: int, device: str) -> None:
        self.width = width
        self.device = device
        self._source: BlockTable | None = None
        self._synced = np.zeros(0, dtype=np.int64)  # per row, the BlockTable.version the device row holds
        self.rows = torch.zeros((1, width), dtype=torch.int32, device=device)

    @property
    def pad_row(self) -> int:
        return len(self._synced)

    def stale(self, table: BlockTable, slots: np.ndarray) -> np.ndarray:
        """The slots among `slots` whose device row is behind the host's (after following the table's growth)."""
        num_rows = len(table.version)
        if table is not self._source or num_rows != len(self._synced):
            keep = len(self._synced) if table is self._source else 0
            # Untouched rows are -1 on the host at version 0: a fresh row of -1 is in step with them.
            rows = torch.full((num_rows + 1, self.width), -1, dtype=torch.int32, device=self.device)
            rows[:keep] = self.rows[:keep]  # (stream-ordered after the steps that read the old copy)
            rows[num_rows] = 0
            self.rows, self._source = rows, table
            self._synced = np.concatenate([self._synced[:keep], np.zeros(num_rows - keep, dtype=np.int64)])
        return slots[table.version[slots] != self._synced[slots]]

    def synced(self, table: BlockTable, slots: np.ndarray) -> None:
        self._synced[slots] = table.version[slots]


class _StaticBuffers:
    """Every tensor a captured step reads or writes; allocated once for the largest token and sequence buckets.

    The inputs are typed views of one device region with a fixed layout (fields one after the other, then the
    block table, row-major), so a step's inputs travel in one copy from a page-locked staging buffer of the same
    layout: every field, then the block-table rows the captured sequence bucket reads — or, for a step whose
    sequences hold rows of the worker's persistent table, only the rows its device copy lacks (_DeviceBlockTable),
    after which the step's rows are gathered into `block_tables` on the device."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: str,
                 backend: LlmBackend) -> None:
        fields: list[tuple[str, type, int]] = [(name, dtype, max_tokens) for name, dtype, _ in _TOKEN_FIELDS]
        fields += [(name, dtype, max_seqs) for name, dtype, _ in _SEQ_FIELDS + _SAMPLE_FIELDS]
        fields += [(name, dtype, max_seqs + (name == "query_start_loc")) for name, dtype in _OTHER_FIELDS]
        layout, off = [], 0
        for _, dtype, rows in fields:
            layout.append((off, np.dtype(dtype), (rows,)))
            off += aligned(rows * np.dtype(dtype).itemsize)
        self.table_offset = off
        self.table_row_bytes = max_blocks_per_seq * 4
        layout.append((off, np.dtype(np.int32), (max_seqs, max_blocks_per_seq)))
        self.num_bytes = off + max_seqs * self.table_row_bytes
        self.region = torch.zeros(self.num_bytes, dtype=torch.uint8, device=device)
        names = [name for name, _, _ in fields] + ["block_tables"]
        for name, view in zip(names, device_views(self.region, layout)):
            setattr(self, name, view)
        # What capture sees before any upload: no KV write, one token per sequence.
        self.slot_mapping.fill_(-1)
        self.query_start_loc.copy_(torch.arange(max_seqs + 1, dtype=torch.int32))
        self.staging = [backend.staging_buffer(self.num_bytes) for _ in range(SLOTS)]
        self.host = [dict(zip(names, host_views(buf, layout))) for buf in self.staging]
        self._fences = CopyFences(backend)
        self._next = 0
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device_table = _DeviceBlockTable(max_blocks_per_seq, device)
        self.out_tokens = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros(max_seqs, dtype=torch.float32, device=device)
        self.logits: torch.Tensor | None = None  # [max_seqs, vocab]: the mixed graphs' output

    def load(self, step: HostStep, arrays: dict[str, np.ndarray], tokens: int, seqs: int) -> None:
        """Write the step into the next staging slot, padded to `tokens` token rows and `seqs` sequence rows, and
        send it in one copy."""
        i = self._next
        self._next = (i + 1) % SLOTS
        self._fences.wait(i)
        host = self.host[i]
        num_tokens, num_seqs, num_samples = len(step.input_ids), len(step.seq_lens), len(step.sample_rows)
        values = {"input_ids": step.input_ids, "positions": step.positions, "slot_mapping": step.slot_mapping,
                  "seq_lens": step.seq_lens, "state_slots": 0 if step.state_slots is None else step.state_slots,
                  "temperature": arrays["temperature"], "top_p": arrays["top_p"],
                  "top_k": arrays["top_k"], "min_p": arrays["min_p"], "seeds": arrays["seeds"],
                  "sample_positions": arrays["positions"], "sample_rows": step.sample_rows}
        for group, n, size in ((_TOKEN_FIELDS, num_tokens, tokens), (_SEQ_FIELDS, num_seqs, seqs),
                               (_SAMPLE_FIELDS, num_samples, seqs)):
            for name, _, pad in group:
                dst = host[name]
                dst[:n] = values[name]
                dst[n:size] = pad
        p = len(step.pending_pos)
        host["pending_pos"][:p] = step.pending_pos
        host["pending_rows"][:p] = step.pending_rows
        fresh = step.fresh_slots if step.fresh_slots is not None else np.zeros(0, dtype=np.int32)
        host["fresh_slots"][:len(fresh)] = fresh
        qsl = host["query_start_loc"]
        qsl[:num_seqs + 1] = step.query_start_loc
        qsl[num_seqs + 1:seqs + 1] = num_tokens
        table = host["block_tables"]
        if step.table is None or step.slots is None:
            table[:num_seqs] = step.host_block_tables()
            table[num_seqs:seqs] = 0
            end = self.table_offset + seqs * self.table_row_bytes
            self.region[:end].copy_(self.staging[i][:end], non_blocking=True)
            self._fences.copied(i)
            return
        # The persistent table: send the stale rows where the block table goes, fold them into the device copy,
        # then gather the step's rows over them (the copy reads that space before the gather writes it).
        mirror = self.device_table
        stale = mirror.stale(step.table, step.slots)
        d = len(stale)
        if d:
            table[:d] = step.table.blocks[stale, :self.max_blocks_per_seq]
        host["stale_slots"][:d] = stale
        slots = host["table_slots"]
        slots[:num_seqs] = step.slots
        slots[num_seqs:seqs] = mirror.pad_row
        end = self.table_offset + d * self.table_row_bytes
        self.region[:end].copy_(self.staging[i][:end], non_blocking=True)
        self._fences.copied(i)
        if d:
            mirror.rows[self.stale_slots[:d]] = self.block_tables[:d]
        first = contiguous_start(step.slots)
        if first is None:
            torch.index_select(mirror.rows, 0, self.table_slots[:seqs], out=self.block_tables[:seqs])
        else:  # the common case: one device-to-device copy, then zeros for the padding rows
            self.block_tables[:num_seqs].copy_(mirror.rows[first:first + num_seqs])
            if num_seqs < seqs:
                self.block_tables[num_seqs:seqs].zero_()
        mirror.synced(step.table, stale)

    def attention_batch(self, tokens: int, seqs: int, block_size: int, max_seq_len: int,
                        decode: bool, max_chunk_seqs: int | None = None) -> AttentionBatch:
        return AttentionBatch(
            positions=self.positions[:tokens],
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.query_start_loc[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            max_query_len=1 if decode else tokens,
            max_seq_len=max_seq_len,
            is_decode=decode,
            block_size=block_size,
            max_chunk_seqs=max_chunk_seqs,
        )

    def sampling_batch(self, size: int, all_greedy: bool) -> SamplingBatch:
        return SamplingBatch(
            temperature=self.temperature[:size],
            top_p=self.top_p[:size],
            top_k=self.top_k[:size],
            min_p=self.min_p[:size],
            seeds=self.seeds[:size],
            positions=self.sample_positions[:size],
            all_greedy=all_greedy,
        )


class GraphModelRunner(ModelRunner):
    """A ModelRunner whose decode steps of up to max(capture_sizes) sequences, and whose mixed steps of up to
    max(capture_tokens) tokens, replay CUDA graphs."""

    def __init__(self, *args: Any, capture_sizes: Seq[int], capture_tokens: Seq[int] = (), mixed_chunk_seqs: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The mixed graphs' bound on a step's prompt chunks (`Config.mixed_graph_chunk_seqs`; 0: none).
        self.mixed_chunk_seqs = mixed_chunk_seqs
        self.capture_sizes = sorted(set(capture_sizes))
        self.capture_tokens = sorted({t for t in capture_tokens if t >= self.capture_sizes[0]})
        # Mixed graphs need a sequence bucket per token bucket: powers of two (and the largest size) suffice there.
        self.mixed_seq_sizes = sorted({s for s in self.capture_sizes if s & (s - 1) == 0} | {self.capture_sizes[-1]})
        max_tokens = max([self.capture_sizes[-1], *self.capture_tokens])
        self._buf = _StaticBuffers(max_tokens, self.capture_sizes[-1], self.max_blocks_per_seq, self.device,
                                   self.backend)
        self._graphs: dict[tuple[int, bool], Any] = {}  # decode: (size, greedy)
        self._mixed: dict[tuple[int, int], Any] = {}  # mixed: (token bucket, sequence bucket)
        self._decode_logits: dict[int, Any] = {}  # decode up to the logits, for rows that need processing: size
        self._masked: dict[tuple[int, bool], Any] = {}  # grammar rows' sampling after those: (size, greedy)
        self._masks: GrammarMasks | None = None
        self.graph_steps = 0  # decode replays so far (tests and logs read it)
        self.decode_logits_steps = 0  # of them, those that stopped at the logits
        self.masked_sample_steps = 0  # steps whose grammar rows were sampled by a masked sampling graph
        self.mixed_graph_steps = 0
        self.eager_steps = 0

    @property
    def eager_min_tokens(self) -> int:
        """Past the largest mixed graph (with none captured, as for a hybrid model: every mixed step)."""
        return self.capture_tokens[-1] + 1 if self._mixed else 1

    @property
    def graph_step_tokens(self) -> tuple[int, ...]:
        """The token buckets of the mixed-step graphs captured (none before `capture`, or for a hybrid model)."""
        return tuple(self.capture_tokens) if self._mixed else ()

    def capture(self) -> None:
        max_seq_len = self.max_blocks_per_seq * self.block_size
        for size in reversed(self.capture_sizes):  # largest first: later graphs reuse its pool memory
            for greedy in (True, False):
                self._graphs[(size, greedy)] = self.backend.capture_graph(self._decode_fn(size, max_seq_len, greedy))
        buf = self._buf
        # (zeros: the padding rows of a masked sampling graph read rows no step wrote yet; finite keeps them quiet)
        buf.logits = torch.zeros((self.capture_sizes[-1], self.model.spec.vocab_size), dtype=torch.float32,
                                 device=self.device)
        for size in reversed(self.capture_sizes):
            self._decode_logits[size] = self.backend.capture_graph(self._decode_fn(size, max_seq_len, None))
        self._masks = GrammarMasks(self.capture_sizes[-1], self.model.spec.vocab_size, self.device, self.backend)
        for size in reversed(self.capture_sizes):
            for greedy in (True, False):
                self._masked[(size, greedy)] = self.backend.capture_graph(masked_sample_fn(
                    self._masks, self._sampler, buf.logits[:size], buf.sampling_batch(size, greedy),
                    buf.out_tokens[:size], buf.out_logprobs[:size]))
        log.info("captured CUDA graphs for decode batch sizes %s (sampling inside, up to the logits, and the "
                 "grammar rows' masked sampling)", self.capture_sizes)
        if not self.capture_tokens:
            return
        if self.state_pools:
            log.info("mixed steps of a model with linear-attention layers run eagerly (no mixed graphs)")
            return
        for tokens in reversed(self.capture_tokens):
            for seqs in reversed([s for s in self.mixed_seq_sizes if s <= tokens]):
                self._mixed[(tokens, seqs)] = self.backend.capture_graph(self._mixed_fn(tokens, seqs, max_seq_len))
        log.info("captured CUDA graphs for mixed steps of up to %s tokens", self.capture_tokens)

    def _decode_fn(self, size: int, max_seq_len: int, greedy: bool | None):  # noqa: ANN202 - a closure for capture
        """A decode step of `size` rows to capture: sampling inside (greedy or not), or, with `greedy` None, up to
        the logits (into `buf.logits`, which the sampler reads after the replay)."""
        buf = self._buf
        batch = buf.attention_batch(size, size, self.block_size, max_seq_len, decode=True)
        state_slots = buf.state_slots[:size] if self.state_pools else None
        sampling, logits_out = None, None
        if greedy is None:
            assert buf.logits is not None
            logits_out = buf.logits[:size]
        else:
            sampling = buf.sampling_batch(size, greedy)

        def step() -> None:
            hidden = self.model.forward(buf.input_ids[:size], batch, self.kv_caches, state_slots)
            logits = self.model.compute_logits(hidden)
            if sampling is None:
                assert logits_out is not None
                logits_out.copy_(logits)
                return
            out = self._sampler.sample(logits, sampling)
            buf.out_tokens[:size].copy_(out.token_ids)
            buf.out_logprobs[:size].copy_(out.logprobs)

        return step

    def _mixed_fn(self, tokens: int, seqs: int, max_seq_len: int):  # noqa: ANN202 - a closure for capture
        buf = self._buf
        batch = buf.attention_batch(tokens, seqs, self.block_size, max_seq_len, decode=False,
                                    max_chunk_seqs=self.mixed_chunk_seqs or None)
        assert buf.logits is not None
        logits = buf.logits[:seqs]

        def step() -> None:
            hidden = self.model.forward(buf.input_ids[:tokens], batch, self.kv_caches)
            logits.copy_(self.model.compute_logits(hidden[buf.sample_rows[:seqs]]))

        return step

    def _bucket(self, scheduled: Seq[ScheduledSeq]) -> tuple[int, int, str] | None:
        """(token bucket, sequence bucket, DECODE / DECODE_LOGITS / MIXED) of a step a graph can run, else None."""
        n = len(scheduled)
        if not self._graphs or n == 0 or n > self.capture_sizes[-1]:
            return None
        # A row that needs logits processing (penalties, min_tokens, top logprobs, a grammar) cannot use a decode
        # graph that samples inside; the decode graphs that stop at the logits, and the mixed ones, serve such a
        # batch. Prompt logprobs (which count as processing until the prompt is done) read the hidden rows of
        # every prompt token, which a graph drops: eager.
        # The image inputs of a prompt (tower embeddings scattered in, 3-D rotary rows) are eager work.
        if any(s.seq.num_computed < s.seq.multimodal_until for s in scheduled):
            return None
        processing = any(s.seq.needs_processing for s in scheduled)
        if processing and needs_prompt_logprobs(scheduled):
            return None
        if all(s.num_new == 1 and s.samples for s in scheduled):  # every row decodes (and so samples)
            seqs = self.capture_sizes[bisect.bisect_left(self.capture_sizes, n)]
            return seqs, seqs, DECODE_LOGITS if processing else DECODE
        seqs = self.mixed_seq_sizes[bisect.bisect_left(self.mixed_seq_sizes, n)]
        need = max(sum(s.num_new for s in scheduled), seqs)  # a graph of T tokens was captured for S <= T
        if not self._mixed or need > self.capture_tokens[-1]:
            return None
        if self.mixed_chunk_seqs and sum(s.num_new > 1 for s in scheduled) > self.mixed_chunk_seqs:
            return None  # more prompt chunks than the graphs' prefill attention has programs for
        return self.capture_tokens[bisect.bisect_left(self.capture_tokens, need)], seqs, MIXED

    @torch.inference_mode()
    def launch(self, scheduled: Seq[ScheduledSeq]) -> LaunchedStep:
        bucket = self._bucket(scheduled)
        if bucket is None:
            self.eager_steps += 1
            return super().launch(scheduled)
        tokens, seqs, kind = bucket
        trace = self.backend.trace_range
        buf = self._buf
        with trace("prepare"):
            step = prepare_step(scheduled, self.block_size, self.max_blocks_per_seq,
                                state_slots=bool(self.state_pools), rope_deltas=self.images is not None)
            arrays = sampling_arrays(step.sampling_seqs)
            greedy = bool((arrays["temperature"] == 0).all())
            buf.load(step, arrays, tokens, seqs)
            p = len(step.pending_pos)
            self._fill_pending(buf.input_ids, step, buf.pending_pos[:p], buf.pending_rows[:p])
            fresh = 0 if step.fresh_slots is None else len(step.fresh_slots)
            if self.state_pools and fresh:
                self.backend.ops.gdn.reset_slots(self.state_pools, buf.fresh_slots[:fresh])  # type: ignore[union-attr]
        num_samples = len(step.sampling_seqs)
        if kind == DECODE:
            with trace(f"graph_replay_{seqs}"):
                self._graphs[(seqs, greedy)].replay()
            self.graph_steps += 1
            return self._launched(step.sampling_seqs, buf.out_tokens[:num_samples], buf.out_logprobs[:num_samples])
        if kind == DECODE_LOGITS:
            with trace(f"graph_replay_logits_{seqs}"):
                self._decode_logits[seqs].replay()
            self.graph_steps += 1
            self.decode_logits_steps += 1
        else:
            with trace(f"mixed_graph_replay_{tokens}x{seqs}"):
                self._mixed[(tokens, seqs)].replay()
            self.mixed_graph_steps += 1
        if not num_samples:  # every sequence is mid-prefill
            return LaunchedStep(self.num_launches, [])
        with trace("sample"):
            return self._sample_replayed(step.sampling_seqs, greedy)

    def _sample_replayed(self, seqs: list, greedy: bool) -> LaunchedStep:
        """Sample the logits a graph left in `buf.logits`: a batch whose only processing is grammar masks replays
        a masked sampling graph after the host fills the bitmasks (masked_sampling.py); others sample eagerly."""
        buf, n = self._buf, len(seqs)
        assert buf.logits is not None
        plan = plan_processing(seqs)
        if (plan is None or not plan.grammar_only or self.grammars is None or self._masks is None
                or not masked_sampling_enabled()):
            return self._sample(buf.logits[:n], seqs, buf.sampling_batch(n, greedy), plan)
        grammars = self.grammars
        size = self.capture_sizes[bisect.bisect_left(self.capture_sizes, n)]
        rows, matchers, errors = grammars.prepare(seqs, plan.grammar_rows, self._pending_token)
        self._masks.upload(size, rows, lambda bits: grammars.fill(matchers, bits))
        self._masked[(size, greedy)].replay()
        self.masked_sample_steps += 1
        launched = self._launched(seqs, buf.out_tokens[:n], buf.out_logprobs[:n])
        launched.seq_errors = errors
        return launched
