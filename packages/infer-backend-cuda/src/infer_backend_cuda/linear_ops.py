"""The CUDA adapter's `LinearOps` per weight scheme, bound once per scheme when the model is built.

Dense weights keep the existing paths (cuBLAS, the skinny Triton GEMM and its fused norm / SiLU prologues).
"""

from __future__ import annotations

from typing import Sequence

import torch

from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
from infer_core.ports.linear_ops import LinearOps
from infer_core.quant import QuantMethod, QuantScheme

Operands = Sequence[torch.Tensor]


class DenseLinearOps:
    def __init__(self, math: CudaMathOps, fused: TritonFusedOps, scheme: QuantScheme) -> None:
        self._math = math
        self._fused = fused
        self.scheme = scheme

    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        return self._math.linear(x, weight[0], bias)

    def add_rms_norm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: Operands, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fused.add_rms_norm_linear(x, residual, norm_weight, eps, weight[0], bias)

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        return self._fused.silu_mul_linear(gate_up, weight[0], bias)


class CudaLinears:
    def __init__(self, math: CudaMathOps, fused: TritonFusedOps) -> None:
        self._math = math
        self._fused = fused
        self._bound: dict[QuantScheme, LinearOps] = {}

    def bind(self, scheme: QuantScheme) -> LinearOps:
        if scheme not in self._bound:
            if scheme.method is not QuantMethod.DENSE:
                raise ValueError(f"the cuda backend cannot serve {scheme.method.value} weights")
            self._bound[scheme] = DenseLinearOps(self._math, self._fused, scheme)
        return self._bound[scheme]
