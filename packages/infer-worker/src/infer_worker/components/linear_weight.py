"""A linear layer's weight in its scheme's layout (dense, AWQ int4, block FP8): the device tensors, the operands
the backend's bound ops take, and the checkpoint slots of each fused part.

Fused projections concatenate their parts along the output dimension in every layout: AWQ along the packed
`out/8` columns of qweight/qzeros and the `out` columns of scales, FP8 along the rows of weight and the block rows
of weight_scale_inv. Each FP8 part keeps its own (possibly partial) last block of scale rows, and `scale_row`
maps every output row to its scale row, so parts of any size fuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from infer_core.quant import AWQ_PACK, QuantMethod, QuantScheme
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty

Parts = Sequence[tuple[str, int]]  # (checkpoint module name, relative to the linear's owner; out_features)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class LinearWeight:
    scheme: QuantScheme
    tensors: dict[str, torch.Tensor]  # checkpoint suffix -> the fused tensor
    operands: tuple[torch.Tensor, ...]  # what `LinearOps` takes (linear_ops.py documents the order)
    slots: WeightSlots  # checkpoint name (relative to the owner) -> slot over the fused tensors

    @classmethod
    def dense(cls, weight: torch.Tensor) -> "LinearWeight":
        """A dense weight over an existing tensor (a tied head over the embedding table)."""
        return cls(QuantScheme(), {"weight": weight}, (weight,), {"weight": WeightSlot(weight, WeightInit.NORMAL)})

    @classmethod
    def allocate(
        cls, scheme: QuantScheme, in_features: int, parts: Parts, dtype: torch.dtype, device: str,
        owner: str = "",
    ) -> "LinearWeight":
        """Fused weight of `parts` (a single unnamed part `("", out)` for a plain linear); `owner` is the module
        path used in refusals. Checks every part against its layout first."""
        for name, size in parts:
            scheme.check(_qualify(owner, name) if name else owner, size, in_features)
        return _ALLOCATORS[scheme.method](scheme, in_features, parts, dtype, device)


def _qualify(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _dense(scheme: QuantScheme, in_features: int, parts: Parts, dtype: torch.dtype, device: str) -> LinearWeight:
    weight = empty((sum(n for _, n in parts), in_features), dtype, device)
    slots, start = {}, 0
    for name, size in parts:
        slots[_qualify(name, "weight")] = WeightSlot(weight[start : start + size], WeightInit.NORMAL)
        start += size
    return LinearWeight(scheme, {"weight": weight}, (weight,), slots)


def _awq(scheme: QuantScheme, in_features: int, parts: Parts, dtype: torch.dtype, device: str) -> LinearWeight:
    total, groups = sum(n for _, n in parts), in_features // scheme.group_size
    qweight = empty((in_features, total // AWQ_PACK), torch.int32, device)
    qzeros = empty((groups, total // AWQ_PACK), torch.int32, device)
    scales = empty((groups, total), torch.float16, device)  # fp16 as published: (q - z) * s is exact in fp32
    slots, start = {}, 0
    for name, size in parts:
        packed = slice(start // AWQ_PACK, (start + size) // AWQ_PACK)
        slots[_qualify(name, "qweight")] = WeightSlot(qweight[:, packed], WeightInit.RANDOM_BITS)
        slots[_qualify(name, "qzeros")] = WeightSlot(qzeros[:, packed], WeightInit.AWQ_ZERO_POINT)
        slots[_qualify(name, "scales")] = WeightSlot(scales[:, start : start + size], WeightInit.AWQ_SCALE)
        start += size
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    return LinearWeight(scheme, tensors, (qweight, qzeros, scales), slots)


def _fp8_block(scheme: QuantScheme, in_features: int, parts: Parts, dtype: torch.dtype, device: str) -> LinearWeight:
    block_out, block_in = scheme.block
    total = sum(n for _, n in parts)
    scale_rows = sum(_cdiv(n, block_out) for _, n in parts)
    weight = empty((total, in_features), torch.float8_e4m3fn, device)
    # fp32 whether the checkpoint holds bf16 or fp32 scales: both load exactly.
    scale_inv = empty((scale_rows, _cdiv(in_features, block_in)), torch.float32, device)
    row_of: list[torch.Tensor] = []
    slots, start, first_row = {}, 0, 0
    for name, size in parts:
        rows = _cdiv(size, block_out)
        slots[_qualify(name, "weight")] = WeightSlot(weight[start : start + size], WeightInit.FP8_NORMAL)
        scale_slot = WeightSlot(scale_inv[first_row : first_row + rows], WeightInit.FP8_SCALE)
        slots[_qualify(name, "weight_scale_inv")] = scale_slot
        row_of.append(first_row + torch.arange(size, dtype=torch.int32) // block_out)
        start, first_row = start + size, first_row + rows
    scale_row = torch.cat(row_of).to(device)
    tensors = {"weight": weight, "weight_scale_inv": scale_inv}
    return LinearWeight(scheme, tensors, (weight, scale_inv, scale_row), slots)


_ALLOCATORS = {QuantMethod.DENSE: _dense, QuantMethod.AWQ: _awq, QuantMethod.FP8_BLOCK: _fp8_block}
