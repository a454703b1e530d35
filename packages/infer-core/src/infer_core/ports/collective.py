"""Collectives for tensor parallelism (identity at tp=1).

Every rank calls every collective in the same order (the ranks run the same forward in lockstep); an adapter
that cannot finish one within the group's operation timeout raises, and the worker treats that as fatal for the
whole rank group (fail-stop)."""

from __future__ import annotations

from typing import Protocol

from infer_core.ports.tensor import Tensor


class Collective(Protocol):
    world_size: int
    rank: int

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum over the ranks of `x`, in place: every rank gets the same values."""
        ...

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """The ranks' `x` concatenated along `dim` in rank order."""
        ...
