"""Collectives for tensor parallelism (identity at tp=1)."""

from __future__ import annotations

from typing import Protocol

from infer_core.ports.tensor import Tensor


class Collective(Protocol):
    world_size: int
    rank: int

    def all_reduce(self, x: Tensor) -> Tensor: ...

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor: ...
