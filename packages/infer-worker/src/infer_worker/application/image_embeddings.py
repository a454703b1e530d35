"""The image embeddings of a step: the vision tower's output for the image placeholders the step computes.

An image goes through the tower once, in the first step whose chunk reaches one of its placeholders; the images a
step reaches first go through together, in tower calls of at most `TOWER_PATCHES_PER_CALL` patches (or one image,
if larger; each image attends to itself), so that the memory profile's worst-case tower call bounds every step's. Its embeddings are kept
for the sequence while later chunks of its prefill still need some of them (chunked prefill never recomputes an
image), and dropped once a step has consumed its last placeholder. A sequence admitted again (after preemption)
starts over. The model scatters the step's embeddings into its input embeddings at the rows returned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from infer_protocol.messages import ImageInput
from infer_worker.application.patch_values import check_patches, patch_values
from infer_worker.components.vision import VisionTower

# Patches per tower call (four 1024x1024 images): what the memory profile gives the tower at least.
TOWER_PATCHES_PER_CALL = 16384


def tower_groups(patches: Sequence[int], budget: int = TOWER_PATCHES_PER_CALL) -> list[range]:
    """Consecutive images (by their patch counts) in groups of at most `budget` patches, a larger image alone."""
    groups, start, total = [], 0, 0
    for i, n in enumerate(patches):
        if i > start and total + n > budget:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(patches):
        groups.append(range(start, len(patches)))
    return groups


def worst_case_grid(tower: VisionTower, max_image_pixels: int) -> tuple[int, int, int]:
    """The patch grid of the largest tower call a step can make: the largest image the server accepts
    (`max_image_pixels`) or a full call of `TOWER_PATCHES_PER_CALL` patches, whichever is more; square, and
    divisible by the merge size."""
    config = tower.config
    patches = max(TOWER_PATCHES_PER_CALL, max_image_pixels // config.patch_size**2)
    merge = config.spatial_merge_size
    root = math.isqrt(patches - 1) + 1  # the smallest side whose square holds `patches`
    side = -(-root // merge) * merge
    return 1, side, side


def profile_tower(tower: VisionTower, max_image_pixels: int) -> None:
    """Run the tower on its worst-case call (for the worker's memory profile)."""
    grid = worst_case_grid(tower, max_image_pixels)
    pixels = torch.zeros(grid[0] * grid[1] * grid[2], tower.config.patch_dim, dtype=tower.dtype, device=tower.device)
    tower(pixels, [grid])


class StepChunk(NamedTuple):
    """Tokens `[start, end)` of a sequence that a step computes; `row`: the step row of token `start`."""

    seq_id: int
    start: int
    end: int
    row: int


@dataclass
class _SeqImages:
    images: list[ImageInput]
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> [num_tokens, out_hidden]


class ImageEmbeddings:
    def __init__(self, tower: VisionTower, patches_per_call: int = TOWER_PATCHES_PER_CALL) -> None:
        self.tower = tower
        self.patches_per_call = patches_per_call
        self._seqs: dict[int, _SeqImages] = {}

    @property
    def num_cached(self) -> int:
        """Images whose embeddings are held (computed, not yet fully consumed)."""
        return sum(len(s.embeddings) for s in self._seqs.values())

    def admit(self, seq_id: int, images: Sequence[ImageInput]) -> None:
        """A sequence arrives (or comes back after preemption: everything is recomputed)."""
        for i, image in enumerate(images):
            if self.tower.num_tokens(image.grid_thw) != image.num_tokens or image.shape[0] != (
                    image.grid_thw[0] * image.grid_thw[1] * image.grid_thw[2]):
                raise ValueError(f"image {i} of sequence {seq_id}: grid {image.grid_thw} does not give its "
                                 f"{image.num_tokens} tokens and {image.shape[0]} patches")
            try:
                check_patches(image, self.tower.config)
            except ValueError as exc:
                raise ValueError(f"image {i} of sequence {seq_id}: {exc}") from None
        if images:
            self._seqs[seq_id] = _SeqImages(list(images))
        else:
            self._seqs.pop(seq_id, None)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def step_embeddings(self, chunks: Sequence[StepChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows `[K]` int64, embeddings `[K, out_hidden]`) of every image placeholder the step computes, or None
        when it computes none."""
        wanted: list[tuple[StepChunk, _SeqImages, int, int, int]] = []
        first: list[tuple[_SeqImages, int]] = []
        for chunk in chunks:
            state = self._seqs.get(chunk.seq_id)
            if state is None:
                continue
            for i, image in enumerate(state.images):
                lo, hi = max(chunk.start, image.offset), min(chunk.end, image.offset + image.num_tokens)
                if lo >= hi:
                    continue
                wanted.append((chunk, state, i, lo, hi))
                if i not in state.embeddings:
                    first.append((state, i))
        if not wanted:
            return None
        if first:
            self._encode(first)
        device = self.tower.device
        rows, embeddings = [], []
        for chunk, state, i, lo, hi in wanted:
            image = state.images[i]
            rows.append(torch.arange(chunk.row + lo - chunk.start, chunk.row + hi - chunk.start, device=device))
            embeddings.append(state.embeddings[i][lo - image.offset:hi - image.offset])
            if hi == image.offset + image.num_tokens:
                del state.embeddings[i]  # its last placeholder is consumed now
        return torch.cat(rows), torch.cat(embeddings)

    def _encode(self, images: list[tuple[_SeqImages, int]]) -> None:
        device = self.tower.device
        per_channel = self.tower.config.values_per_channel
        sizes = [math.prod(state.images[i].grid_thw) for state, i in images]
        for group in tower_groups(sizes, self.patches_per_call):
            part_images = [images[j] for j in group]
            pixels = torch.cat([patch_values(state.images[i], per_channel, device) for state, i in part_images])
            out = self.tower(pixels, [state.images[i].grid_thw for state, i in part_images])
            for (state, i), part in zip(part_images, out.split([state.images[i].num_tokens
                                                                for state, i in part_images]), strict=True):
                state.embeddings[i] = part
