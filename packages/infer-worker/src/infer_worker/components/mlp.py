"""Gated MLP: one GEMM for gate and up, SiLU(gate) * up, the down projection. The decoder layer runs the norm, the
gate / up GEMM and the activation as one op (`RMSNorm.project_silu_mul`), then `down_proj`."""

from __future__ import annotations

import torch

from infer_core.ports.op_ports import OpPorts
from infer_core.quant import DENSE_CONFIG, ModuleQuant
from infer_worker.components.linear import Linear, MergedLinear
from infer_worker.components.sharding import Parallel
from infer_worker.components.weights import WeightSlots, prefixed


class GatedMlp:
    def __init__(
        self, ops: OpPorts, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype, device: str,
        quant: ModuleQuant = ModuleQuant(DENSE_CONFIG),
    ) -> None:
        gate_up = (("gate_proj", intermediate_size), ("up_proj", intermediate_size))
        self.gate_up_proj = MergedLinear(
            ops, hidden_size, gate_up, bias, dtype, device, quant.fused_scheme(("gate_proj", "up_proj")),
            quant.name(""), Parallel.COLUMN,
        )
        self.down_proj = Linear.allocate(
            ops, intermediate_size, hidden_size, bias, dtype, device, quant.scheme("down_proj"),
            quant.name("down_proj"), Parallel.ROW,
        )

    def weight_slots(self) -> WeightSlots:
        return {**self.gate_up_proj.weight_slots(), **prefixed("down_proj.", self.down_proj.weight_slots())}
