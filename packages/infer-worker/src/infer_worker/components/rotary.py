"""Rotary position embedding tables (NeoX layout), with the frequency scalings checkpoints declare.

The cache is `[max_positions, head_dim]` float32: `cos(pos * inv_freq)` in the first half of the last dim and
`sin(pos * inv_freq)` in the second. It is computed the way HF does (float32 inverse frequencies, float32
products), so fp32 logits match the oracle closely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.x frequency scaling (HF `rope_type = "llama3"`)."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """`[head_dim / 2]` float32 rotation speeds."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None, device: str
) -> torch.Tensor:
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
