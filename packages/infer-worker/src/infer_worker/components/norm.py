"""RMSNorm; `add` fuses the residual addition that precedes every norm after the first.

`offset` is the checkpoint's convention for the scale: 0 for `w * x` (Llama), 1 for `(1 + w) * x` (Qwen3.5), whose
weights are loaded as `1 + w` so that one op serves both."""

from __future__ import annotations

import torch

from infer_core.ports.op_ports import OpPorts
from infer_worker.components.linear import Linear
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty


class RMSNorm:
    def __init__(self, ops: OpPorts, size: int, eps: float, dtype: torch.dtype, device: str,
                 offset: float = 0.0) -> None:
        self._fused = ops.fused
        self.weight = empty((size,), dtype, device)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual = x + residual`; returns `(norm(residual), residual)`."""
        return self._fused.add_rms_norm(x, residual, self.weight, self.eps)

    def project(
        self, x: torch.Tensor, residual: torch.Tensor | None, linear: Linear
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual = x + residual` (`x` when None); returns `(linear(norm(residual)), residual)`, fused."""
        return linear.add_rms_norm_linear(x, residual, self.weight, self.eps)

    def project_silu_mul(
        self, x: torch.Tensor, residual: torch.Tensor | None, gate_up: Linear
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `project` into a `[gate | up]` linear; returns `(silu(gate) * up, residual)`, fused."""
        return gate_up.add_rms_norm_linear_silu_mul(x, residual, self.weight, self.eps)

    def weight_slots(self) -> WeightSlots:
        return {"weight": WeightSlot(self.weight, WeightInit.ONES, self.offset)}
