"""Tensor parallelism declared as data: how a layer splits over the ranks (`Parallel`) and which slice of a
checkpoint tensor one rank holds (`Shard`, carried by its `WeightSlot`).

Megatron's layout: column-parallel projections (qkv, gate_up) keep their output split by heads or channels,
row-parallel ones (o_proj, down) take that split input and all-reduce their partial sums, and the vocabulary
(embedding rows, lm_head rows) is split too, the logits all-gathered so every rank samples the full distribution.
At one rank nothing is split and no collective runs.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import torch


class Parallel(Enum):
    REPLICATED = "replicated"  # every rank holds all of it
    COLUMN = "column"  # out features split; the output stays split (qkv, gate_up)
    ROW = "row"  # in features split; the partial outputs are all-reduced (o_proj, down)
    VOCAB = "vocab"  # out features split, the outputs all-gathered (lm_head)

    @property
    def shard_dim(self) -> int | None:
        """The dimension of a `[out, in]` weight (dense or FP8 codes, and FP8's block scales) that is split."""
        return {Parallel.COLUMN: 0, Parallel.VOCAB: 0, Parallel.ROW: 1}.get(self)

    def local_features(self, in_features: int, out_features: int, world: int, owner: str) -> tuple[int, int]:
        """This rank's (in, out) features."""
        if self is Parallel.ROW:
            return split(in_features, world, f"{owner} in_features"), out_features
        if self in (Parallel.COLUMN, Parallel.VOCAB):
            return in_features, split(out_features, world, f"{owner} out_features")
        return in_features, out_features


class Shard(NamedTuple):
    """Rank `rank` of `world` holds the `rank`-th of `world` equal slices of dimension `dim`."""

    dim: int
    rank: int
    world: int

    def bounds(self, full: int, name: str) -> tuple[int, int]:
        size = split(full, self.world, f"weight {name!r} dimension {self.dim}")
        return self.rank * size, (self.rank + 1) * size

    def take(self, name: str, value: torch.Tensor) -> torch.Tensor:
        start, end = self.bounds(value.shape[self.dim], name)
        return value.narrow(self.dim, start, end - start)


def shard_of(parallel: Parallel, rank: int, world: int) -> Shard | None:
    dim = parallel.shard_dim
    return None if world == 1 or dim is None else Shard(dim, rank, world)


def split(total: int, world: int, what: str) -> int:
    """`total / world`, refused in one line naming `what` when it does not divide."""
    if total % world:
        raise ValueError(f"{what} = {total} does not divide by tensor_parallel_size {world}")
    return total // world
