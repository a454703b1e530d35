"""Collectives of the CPU backend: the identity for one process, gloo over torch.distributed for a rank group."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class SingleProcessCollective:
    world_size: int = 1
    rank: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


class GlooCollective:
    """The ranks of the default torch.distributed group, over a gloo group of their own (so the worker's plan
    broadcasts on the default group never interleave with the model's collectives)."""

    def __init__(self, timeout_s: float) -> None:
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.world_size: int = dist.get_world_size(self._group)
        self.rank: int = dist.get_rank(self._group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self._group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self._group)
        return torch.cat(parts, dim=dim)
