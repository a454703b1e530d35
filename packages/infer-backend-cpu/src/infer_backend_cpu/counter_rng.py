"""Counter-based uniform noise for seeded sampling: a pure function of (seed, position, vocab index).

No generator state exists anywhere, so a seeded request draws the same numbers whatever it is batched with,
and a CUDA graph can replay the draw. The CUDA backend implements the very same integer formula; both use
int64 arithmetic on values kept in [0, 2**32), so every intermediate product fits (< 2**59).

    mix32(x)  = ((x >> 16) ^ x) * 0x45D9F3B & M, twice, then (x >> 16) ^ x        with M = 0xFFFFFFFF
    h[row]    = mix32((seed & M) ^ mix32(position & M))
    u[row, v] = (float64(mix32((h[row] + v) & M)) + 0.5) / 2**32                 strictly inside (0, 1)

`u` is formed in float64 because float32 cannot hold 32-bit integers: a value near 2**32 would round to
exactly 1.0 and make the exponential noise `-log(u)` zero.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B
_TWO_POW_32 = float(2**32)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of an int64 tensor with values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MULTIPLIER) & MASK32
    x = (((x >> 16) ^ x) * _MULTIPLIER) & MASK32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-row stream key `[N]` int64 from the request seed and the index of the token being sampled."""
    return mix32((seeds.to(torch.int64) & MASK32) ^ mix32(positions.to(torch.int64) & MASK32))


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise `[N, vocab_size]` float64 in (0, 1), one independent value per (row, vocab index)."""
    keys = row_keys(seeds, positions)
    vocab_index = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    bits = mix32((keys[:, None] + vocab_index[None, :]) & MASK32)
    return (bits.to(torch.float64) + 0.5) / _TWO_POW_32
