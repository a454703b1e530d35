"""Linear layers with HF-layout weights `[out_features, in_features]`.

`MergedLinear` stacks several checkpoint projections along the output dimension (q/k/v, gate/up) so one GEMM
computes them all; each part stays separately loadable as a slot over its row range.
"""

from __future__ import annotations

from typing import Sequence

import torch

from infer_core.ports.op_ports import OpPorts
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty


class Linear:
    def __init__(self, ops: OpPorts, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._math = ops.math
        self.weight = weight
        self.bias = bias

    @classmethod
    def allocate(
        cls, ops: OpPorts, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: str
    ) -> "Linear":
        return cls(ops, empty((out_features, in_features), dtype, device), empty((out_features,), dtype, device) if bias else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._math.linear(x, self.weight, self.bias)

    def weight_slots(self) -> WeightSlots:
        slots = {"weight": WeightSlot(self.weight, WeightInit.NORMAL)}
        if self.bias is not None:
            slots["bias"] = WeightSlot(self.bias, WeightInit.ZEROS)
        return slots


class MergedLinear(Linear):
    """Parts `(name, out_features)` concatenated along the output rows, in order."""

    def __init__(
        self,
        ops: OpPorts,
        in_features: int,
        parts: Sequence[tuple[str, int]],
        bias: bool,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        total = sum(size for _, size in parts)
        super().__init__(ops, empty((total, in_features), dtype, device), empty((total,), dtype, device) if bias else None)
        self.parts = tuple(parts)
        self.part_sizes = tuple(size for _, size in parts)

    def weight_slots(self) -> WeightSlots:
        slots: WeightSlots = {}
        start = 0
        for name, size in self.parts:
            slots[f"{name}.weight"] = WeightSlot(self.weight[start : start + size], WeightInit.NORMAL)
            if self.bias is not None:
                slots[f"{name}.bias"] = WeightSlot(self.bias[start : start + size], WeightInit.ZEROS)
            start += size
        return slots
