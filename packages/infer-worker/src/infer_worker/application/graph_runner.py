"""CUDA-graph decode (nano-vllm style): one graph per capture size over address-stable buffers; a decode
batch is copied into the buffers, padded to the next captured size (padding rows: slot -1, context 0, greedy)
and replayed. Attention, norms, RoPE, the KV store and sampling all run inside the graph; PENDING input ids are
gathered into the input buffer from the previous launch's sampled tokens just before the replay. Mixed or larger
batches, and batches with a row that needs logits processing (penalties, min_tokens masking, top logprobs),
fall back to the eager path of ModelRunner."""

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

from infer_worker.application.input_upload import SLOTS, aligned, device_views
from infer_worker.application.model_runner import HostStep, LaunchedStep, ModelRunner, prepare_step, sampling_arrays
from infer_worker.domain.sequence import ScheduledSeq

log = logging.getLogger("rustinfer.worker")


# The uploaded per-row inputs of a captured step: (name, dtype, value of a padding row).
_ROW_FIELDS: tuple[tuple[str, type, float], ...] = (
    ("input_ids", np.int64, 0), ("positions", np.int64, 0), ("slot_mapping", np.int64, -1), ("seq_lens", np.int32, 0),
    ("temperature", np.float32, 0), ("top_p", np.float32, 1), ("top_k", np.int32, 0), ("min_p", np.float32, 0),
    ("seeds", np.int64, 0), ("sample_positions", np.int64, 0),
)
# Also uploaded: the PENDING inputs' positions and source rows (a prefix of them is used), and query_start_loc,
# which is 0, 1, ..., B for every decode batch (B + 1 entries).
_OTHER_FIELDS: tuple[tuple[str, type], ...] = (
    ("pending_pos", np.int64), ("pending_rows", np.int64), ("query_start_loc", np.int32))


class _StaticBuffers:
    """Every tensor a captured decode step reads or writes; allocated once at the largest capture size.

    The inputs are typed views of one device region with a fixed layout (one row per sequence per field, then the
    block table, row-major), so a step's inputs travel in one copy from a page-locked staging buffer of the same
    layout: the rows of every field, then the block-table rows the captured size reads."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: str, backend: LlmBackend) -> None:
        layout, off = [], 0
        fields = [(name, dtype) for name, dtype, _ in _ROW_FIELDS] + list(_OTHER_FIELDS)
        for name, dtype in fields:
            rows = max_batch + 1 if name == "query_start_loc" else max_batch
            layout.append((off, np.dtype(dtype), (rows,)))
            off += aligned(rows * np.dtype(dtype).itemsize)
        self.table_offset = off
        self.table_row_bytes = max_blocks_per_seq * 4
        layout.append((off, np.dtype(np.int32), (max_batch, max_blocks_per_seq)))
        self.num_bytes = off + max_batch * self.table_row_bytes
        self.region = torch.zeros(self.num_bytes, dtype=torch.uint8, device=device)
        views = device_views(self.region, layout)
        names = [name for name, _ in fields] + ["block_tables"]
        for name, view in zip(names, views):
            setattr(self, name, view)
        # What capture sees before any upload: no KV write, one token per sequence.
        self.slot_mapping.fill_(-1)
        self.query_start_loc.copy_(torch.arange(max_batch + 1, dtype=torch.int32))
        self.staging = [backend.staging_buffer(self.num_bytes) for _ in range(SLOTS)]
        self.host = [dict(zip(names, _host_views(buf, layout))) for buf in self.staging]
        for host in self.host:
            host["query_start_loc"][:] = np.arange(max_batch + 1, dtype=np.int32)  # one token per sequence
            host["slot_mapping"][:] = -1
        self._next = 0
        self.out_tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros(max_batch, dtype=torch.float32, device=device)

    def load(self, step: HostStep, arrays: dict[str, np.ndarray], n: int, size: int) -> None:
        """Write the step's rows (padding rows up to `size`) into the next staging slot and send them in one copy."""
        i = self._next
        self._next = (i + 1) % SLOTS
        host = self.host[i]
        values = {"input_ids": step.input_ids, "positions": step.positions, "slot_mapping": step.slot_mapping,
                  "seq_lens": step.seq_lens, "temperature": arrays["temperature"], "top_p": arrays["top_p"],
                  "top_k": arrays["top_k"], "min_p": arrays["min_p"], "seeds": arrays["seeds"],
                  "sample_positions": arrays["positions"]}
        for name, _, pad in _ROW_FIELDS:
            dst = host[name]
            dst[:n] = values[name]
            dst[n:size] = pad
        p = len(step.pending_pos)
        host["pending_pos"][:p] = step.pending_pos
        host["pending_rows"][:p] = step.pending_rows
        table = host["block_tables"]
        table[:n] = step.block_tables
        table[n:size] = 0
        end = self.table_offset + size * self.table_row_bytes
        self.region[:end].copy_(self.staging[i][:end], non_blocking=True)

    def attention_batch(self, size: int, block_size: int, max_seq_len: int) -> AttentionBatch:
        return AttentionBatch(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            is_decode=True,
            block_size=block_size,
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


def _host_views(buf: torch.Tensor, layout: list[tuple[int, np.dtype, tuple[int, ...]]]) -> list[np.ndarray]:
    raw = buf.numpy()
    return [raw[off:off + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape) for off, dtype, shape in layout]


class GraphModelRunner(ModelRunner):
    """A ModelRunner whose pure-decode steps of up to max(capture_sizes) sequences replay CUDA graphs."""

    def __init__(self, *args: Any, capture_sizes: Seq[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture_sizes = sorted(set(capture_sizes))
        self._buf = _StaticBuffers(self.capture_sizes[-1], self.max_blocks_per_seq, self.device, self.backend)
        self._graphs: dict[tuple[int, bool], Any] = {}
        self.graph_steps = 0  # replays so far (tests and logs read it)

    def capture(self) -> None:
        max_seq_len = self.max_blocks_per_seq * self.block_size
        for size in reversed(self.capture_sizes):  # largest first: later graphs reuse its pool memory
            for greedy in (True, False):
                self._graphs[(size, greedy)] = self.backend.capture_graph(self._step_fn(size, greedy, max_seq_len))
        log.info("captured CUDA graphs for decode batch sizes %s", self.capture_sizes)

    def _step_fn(self, size: int, greedy: bool, max_seq_len: int):  # noqa: ANN202 - a closure for capture
        buf = self._buf
        batch = buf.attention_batch(size, self.block_size, max_seq_len)
        sampling = buf.sampling_batch(size, greedy)

        def step() -> None:
            hidden = self.model.forward(buf.input_ids[:size], batch, self.kv_caches)
            out = self._sampler.sample(self.model.compute_logits(hidden), sampling)
            buf.out_tokens[:size].copy_(out.token_ids)
            buf.out_logprobs[:size].copy_(out.logprobs)

        return step

    @torch.inference_mode()
    def launch(self, scheduled: Seq[ScheduledSeq]) -> LaunchedStep:
        n = len(scheduled)
        if not self._graphs or n == 0 or n > self.capture_sizes[-1]:
            return super().launch(scheduled)
        # Not a pure decode, or a row needs logits processing (penalties, min_tokens, top logprobs): eager.
        if any(s.num_new != 1 or s.seq.num_computed + 1 != len(s.seq.token_ids)
               or len(s.seq.token_ids) < s.seq.process_until for s in scheduled):
            return super().launch(scheduled)
        trace = self.backend.trace_range
        with trace("prepare"):
            step = prepare_step(scheduled, self.block_size, self.max_blocks_per_seq)
            size = self.capture_sizes[bisect.bisect_left(self.capture_sizes, n)]
            arrays = sampling_arrays(step.sampling_seqs)
            greedy = bool((arrays["temperature"] == 0).all())
            buf = self._buf
            buf.load(step, arrays, n, size)
            p = len(step.pending_pos)
            self._fill_pending(buf.input_ids, step, buf.pending_pos[:p], buf.pending_rows[:p])
        with trace(f"graph_replay_{size}"):
            self._graphs[(size, greedy)].replay()
        self.graph_steps += 1
        return self._launched(step.sampling_seqs, self._buf.out_tokens[:n], self._buf.out_logprobs[:n])
