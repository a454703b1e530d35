"""Gated MLP: one GEMM for gate and up, then SiLU(gate) * up fused with the down projection."""

from __future__ import annotations

import torch

from infer_core.ports.op_ports import OpPorts
from infer_worker.components.linear import Linear, MergedLinear
from infer_worker.components.weights import WeightSlots, prefixed


class GatedMlp:
    def __init__(
        self, ops: OpPorts, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype, device: str
    ) -> None:
        self._fused = ops.fused
        self.gate_up_proj = MergedLinear(
            ops, hidden_size, (("gate_proj", intermediate_size), ("up_proj", intermediate_size)), bias, dtype, device
        )
        self.down_proj = Linear.allocate(ops, intermediate_size, hidden_size, bias, dtype, device)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(hidden))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP after its gate/up GEMM (which the decoder layer fuses with the norm before it)."""
        return self._fused.silu_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias)

    def weight_slots(self) -> WeightSlots:
        return {**self.gate_up_proj.weight_slots(), **prefixed("down_proj.", self.down_proj.weight_slots())}
