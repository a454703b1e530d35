"""The images of the worker's sequences, from admission to their end: what a step adds to its tokens for them.

A sequence admitted with images (its `NewSeq`) gets the 3-D positions of its prompt (`mrope_positions`, when the
model's RoPE is multimodal) and its images are handed to the step's image embeddings (`image_embeddings.py`: each
through the tower once, when a chunk first reaches it). Its tokens after the prompt rotate at their index plus
the delta those positions leave (`Sequence.rope_delta`, applied by `prepare_step`). For each step, `step` gives
the model the placeholder rows with their embeddings and the prompt rows with their 3-D positions. A sequence that
finishes, aborts or is preempted is forgotten; a recomputed one is admitted again from its `NewSeq`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from infer_protocol.messages import ImageInput
from infer_worker.application.image_embeddings import ImageEmbeddings, StepChunk
from infer_worker.components.mrope import ImageSpan, mrope_positions
from infer_worker.components.vision import VisionTower
from infer_worker.domain.sequence import ScheduledSeq, Sequence
from infer_worker.models.causal_lm import StepImages


class ImageInputs:
    def __init__(self, tower: VisionTower, multimodal_rope: bool) -> None:
        """`multimodal_rope`: the text model rotates by 3-D positions (its spec has an `mrope_section`)."""
        self.embeddings = ImageEmbeddings(tower)
        self._merge = tower.config.spatial_merge_size
        self._device = tower.device
        self._multimodal_rope = multimodal_rope
        self._positions: dict[int, np.ndarray] = {}  # seq id -> [3, prompt_len] (multimodal RoPE only)

    @property
    def num_sequences(self) -> int:
        return len(self._positions)

    def admit(self, seq: Sequence, images: Seq[ImageInput]) -> None:
        self.forget(seq.seq_id)
        if not images:
            return
        spans = [ImageSpan(image.offset, image.num_tokens, tuple(image.grid_thw)) for image in images]
        positions, delta = mrope_positions(seq.prompt_len, spans, self._merge)
        self.embeddings.admit(seq.seq_id, images)
        self._positions[seq.seq_id] = positions
        seq.multimodal_until = seq.prompt_len
        seq.rope_delta = delta if self._multimodal_rope else 0

    def forget(self, seq_id: int) -> None:
        self.embeddings.forget(seq_id)
        self._positions.pop(seq_id, None)

    def step(self, scheduled: Seq[ScheduledSeq], query_start_loc: np.ndarray) -> StepImages | None:
        """The step's image inputs, or None when none of its tokens lies in a prompt with images."""
        if not self._positions:  # (the common case of a text-only batch costs no loop)
            return None
        chunks: list[StepChunk] = []
        rope_rows: list[np.ndarray] = []
        rope_positions: list[np.ndarray] = []
        for i, item in enumerate(scheduled):
            seq = item.seq
            start = seq.num_computed
            end = min(start + item.num_new, seq.multimodal_until)
            if start >= end:
                continue
            row = int(query_start_loc[i])
            chunks.append(StepChunk(seq.seq_id, start, start + item.num_new, row))
            if self._multimodal_rope:
                rope_rows.append(np.arange(row, row + end - start))
                rope_positions.append(self._positions[seq.seq_id][:, start:end])
        if not chunks:
            return None
        found = self.embeddings.step_embeddings(chunks)
        embed_rows, embeddings = found if found is not None else (
            torch.zeros(0, dtype=torch.int64, device=self._device),
            torch.zeros(0, self.embeddings.tower.config.out_hidden_size, device=self._device))
        rows = np.concatenate(rope_rows) if rope_rows else np.zeros(0, dtype=np.int64)
        positions = np.concatenate(rope_positions, axis=1) if rope_positions else np.zeros((3, 0), dtype=np.int64)
        return StepImages(embed_rows, embeddings, torch.from_numpy(rows).to(self._device),
                          torch.from_numpy(positions).to(self._device))
