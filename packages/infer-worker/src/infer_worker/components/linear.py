"""Linear layers; the weight's layout (dense `[out, in]`, AWQ int4 or block FP8) is the weight's own data.

Each linear binds its scheme's ops from the backend once, at construction (`ops.linears.bind`), so calling one is
the same whatever the layout. `MergedLinear` stacks several checkpoint projections along the output dimension
(q/k/v, gate/up) so one GEMM computes them all; each part stays separately loadable through its slots.
"""

from __future__ import annotations

from typing import Sequence

import torch

from infer_core.ports.op_ports import OpPorts
from infer_core.quant import DENSE, QuantScheme
from infer_worker.components.linear_weight import LinearWeight
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty


class Linear:
    def __init__(self, ops: OpPorts, weight: LinearWeight, bias: torch.Tensor | None = None) -> None:
        self._ops = ops.linears.bind(weight.scheme)
        self.params = weight
        self.bias = bias

    @classmethod
    def allocate(
        cls, ops: OpPorts, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: str,
        scheme: QuantScheme = DENSE, name: str = "",
    ) -> "Linear":
        """`name` is the module's checkpoint path, for the message when `scheme` cannot hold this size."""
        weight = LinearWeight.allocate(scheme, in_features, (("", out_features),), dtype, device, owner=name)
        return cls(ops, weight, empty((out_features,), dtype, device) if bias else None)

    @property
    def scheme(self) -> QuantScheme:
        return self.params.scheme

    @property
    def weight(self) -> torch.Tensor:
        """The tensor the checkpoint calls `weight` (dense `[out, in]`, or FP8 codes); AWQ has none."""
        return self.params.tensors["weight"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.linear(x, self.params.operands, self.bias)

    def add_rms_norm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`h = x + residual` (`x` when None); `(self(rms_norm(h)), h)`, fused where the backend can."""
        return self._ops.add_rms_norm_linear(x, residual, norm_weight, eps, self.params.operands, self.bias)

    def silu_mul_linear(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`self(silu(gate) * up)`, fused where the backend can."""
        return self._ops.silu_mul_linear(gate_up, self.params.operands, self.bias)

    def weight_slots(self) -> WeightSlots:
        slots = dict(self.params.slots)
        if self.bias is not None:
            slots["bias"] = WeightSlot(self.bias, WeightInit.ZEROS)
        return slots


class MergedLinear(Linear):
    """Parts `(name, out_features)` concatenated along the output dimension, in order; all share one scheme."""

    def __init__(
        self,
        ops: OpPorts,
        in_features: int,
        parts: Sequence[tuple[str, int]],
        bias: bool,
        dtype: torch.dtype,
        device: str,
        scheme: QuantScheme = DENSE,
        owner: str = "",
    ) -> None:
        total = sum(size for _, size in parts)
        weight = LinearWeight.allocate(scheme, in_features, parts, dtype, device, owner=owner)
        super().__init__(ops, weight, empty((total,), dtype, device) if bias else None)
        self.parts = tuple(parts)
        self.part_sizes = tuple(size for _, size in parts)

    def weight_slots(self) -> WeightSlots:
        slots = dict(self.params.slots)
        if self.bias is not None:
            start = 0
            for name, size in self.parts:
                slots[f"{name}.bias"] = WeightSlot(self.bias[start : start + size], WeightInit.ZEROS)
                start += size
        return slots
