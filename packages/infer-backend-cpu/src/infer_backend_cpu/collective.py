"""Collectives of a single process (tensor parallelism of 1): every operation is the identity."""

from __future__ import annotations

import torch


class SingleProcessCollective:
    world_size: int = 1
    rank: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x
