"""Multimodal RoPE (Qwen3.5): a prompt's 3-D positions (transformers' `Qwen3_5Model.get_rope_index`), and the
rotary angles of 3-D positions (its text rotary embedding's interleaved sections).

Each token has three positions (temporal, height, width), which rotate interleaved thirds of the rotary
frequencies (`mrope_section`). A text token has all three equal, counting on from the previous token. An image's
placeholder tokens, in the merge-block order the tower emits, sit on their grid: `(start + t, start + row,
start + column)` with `start` the position after the text before the image; the text after the image continues
from `start + max(grid_h, grid_w) / merge_size`. So a prompt's last position is not its length minus one: the
difference (`delta`, negative when an image is large) carries on through decoding, where the token at index `i`
has position `i + delta` in all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch


class ImageSpan(NamedTuple):
    offset: int  # index of the image's first placeholder token in the prompt
    num_tokens: int
    grid_thw: tuple[int, int, int]  # the tower's patch grid (before merging)


def mrope_positions(num_tokens: int, images: Sequence[ImageSpan], spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """`[3, num_tokens]` int64 positions of a prompt whose images' placeholders lie at `images` (in order,
    disjoint), and the delta that later tokens add to their index."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    current = 0  # the next text position
    end = 0  # where the previous image's placeholders ended
    for image in images:
        if image.offset < end or image.offset + image.num_tokens > num_tokens:
            raise ValueError(f"image placeholders [{image.offset}, {image.offset + image.num_tokens}) are out of order "
                             f"or outside the {num_tokens} tokens")
        text = image.offset - end
        positions[:, end:image.offset] = current + np.arange(text)
        current += text
        t, h, w = image.grid_thw
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if t * gh * gw != image.num_tokens:
            raise ValueError(f"an image of grid {image.grid_thw} has {t * gh * gw} tokens, not {image.num_tokens}")
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")).reshape(3, -1)
        positions[:, image.offset:image.offset + image.num_tokens] = grid + current
        current += max(gh, gw)
        end = image.offset + image.num_tokens
    positions[:, end:] = current + np.arange(num_tokens - end)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: Sequence[int]) -> torch.Tensor:
    """`[N, 2 * len(inv_freq)]` float32 rows `[cos | sin]` (the layout of `rotary.cos_sin_cache`) for tokens at
    `positions` `[3, N]`. Frequency `j` turns with the temporal position, except `j = 1, 4, ...` below
    `3 * mrope_section[1]`, which turn with the height, and `j = 2, 5, ...` below `3 * mrope_section[2]`, with the
    width. A text token (three equal positions) gets ordinary RoPE."""
    if sum(mrope_section) != inv_freq.shape[0]:
        raise ValueError(f"mrope_section {list(mrope_section)} does not cover the {inv_freq.shape[0]} frequencies")
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [3, N, half]
    mixed = angles[0].clone()
    for axis in (1, 2):
        idx = slice(axis, 3 * mrope_section[axis], 3)
        mixed[:, idx] = angles[axis][:, idx]
    return torch.cat((mixed.cos(), mixed.sin()), dim=-1)
