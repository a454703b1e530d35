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

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.sampler import SamplingBatch

from infer_worker.application.model_runner import HostStep, LaunchedStep, ModelRunner, prepare_step, sampling_arrays
from infer_worker.domain.sequence import ScheduledSeq

log = logging.getLogger("rustinfer.worker")


class _StaticBuffers:
    """Every tensor a captured decode step reads or writes; allocated once at the largest capture size."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: str) -> None:
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=i64, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=i32, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=i32, device=device)
        self.temperature = torch.zeros(max_batch, dtype=f32, device=device)
        self.top_p = torch.ones(max_batch, dtype=f32, device=device)
        self.top_k = torch.zeros(max_batch, dtype=i32, device=device)
        self.min_p = torch.zeros(max_batch, dtype=f32, device=device)
        self.seeds = torch.zeros(max_batch, dtype=i64, device=device)
        self.sample_positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.out_tokens = torch.zeros(max_batch, dtype=i64, device=device)
        self.out_logprobs = torch.zeros(max_batch, dtype=f32, device=device)

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


class GraphModelRunner(ModelRunner):
    """A ModelRunner whose pure-decode steps of up to max(capture_sizes) sequences replay CUDA graphs."""

    def __init__(self, *args: Any, capture_sizes: Seq[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture_sizes = sorted(set(capture_sizes))
        self._buf = _StaticBuffers(self.capture_sizes[-1], self.max_blocks_per_seq, self.device)
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
            self._load(step, arrays, n, size)
            self._fill_pending(self._buf.input_ids, step)
        with trace(f"graph_replay_{size}"):
            self._graphs[(size, greedy)].replay()
        self.graph_steps += 1
        return self._launched(step.sampling_seqs, self._buf.out_tokens[:n], self._buf.out_logprobs[:n])

    def _load(self, step: HostStep, arrays: dict[str, np.ndarray], n: int, size: int) -> None:
        buf = self._buf
        pairs = [
            (buf.input_ids, step.input_ids, 0),
            (buf.positions, step.positions, 0),
            (buf.slot_mapping, step.slot_mapping, -1),
            (buf.seq_lens, step.seq_lens, 0),
            (buf.temperature, arrays["temperature"], 0),
            (buf.top_p, arrays["top_p"], 1),
            (buf.top_k, arrays["top_k"], 0),
            (buf.min_p, arrays["min_p"], 0),
            (buf.seeds, arrays["seeds"], 0),
            (buf.sample_positions, arrays["positions"], 0),
        ]
        for dst, src, pad in pairs:
            dst[:n].copy_(torch.from_numpy(src), non_blocking=True)
            if size > n:
                dst[n:size].fill_(pad)
        buf.block_tables[:n].copy_(torch.from_numpy(step.block_tables), non_blocking=True)
        if size > n:
            buf.block_tables[n:size].fill_(0)
