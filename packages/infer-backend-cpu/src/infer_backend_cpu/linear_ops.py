"""The CPU backend's `LinearOps` per weight scheme: dense torch GEMMs, and the quantized layouts' reference
numerics (`quant_math.py`) composed with the reference norm and activation (unfused)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from infer_backend_cpu.fused_ops import CpuFusedOps
from infer_backend_cpu.quant_math import awq_linear, fp8_block_linear
from infer_core.ports.fused_ops import unfused_add_rms_norm_linear, unfused_silu_mul_linear
from infer_core.ports.linear_ops import LinearOps
from infer_core.quant import QuantMethod, QuantScheme

Operands = Sequence[torch.Tensor]


class _Unfused:
    """The norm+GEMM and SiLU+GEMM ops as the separate reference ops, around the scheme's `linear`."""

    scheme: QuantScheme

    def __init__(self, fused: CpuFusedOps, scheme: QuantScheme) -> None:
        self._fused = fused
        self.scheme = scheme

    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def add_rms_norm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: Operands, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return unfused_add_rms_norm_linear(self._fused, self.linear, x, residual, norm_weight, eps, weight, bias)

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        return unfused_silu_mul_linear(self._fused, self.linear, gate_up, weight, bias)


class DenseLinearOps(_Unfused):
    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight[0], bias)


class AwqLinearOps(_Unfused):
    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, qzeros, scales = weight
        return awq_linear(x, qweight, qzeros, scales, bias)


class Fp8BlockLinearOps(_Unfused):
    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        codes, scale_inv, scale_row = weight
        return fp8_block_linear(x, codes, scale_inv, scale_row, self.scheme.block[1], bias)


_OPS = {QuantMethod.DENSE: DenseLinearOps, QuantMethod.AWQ: AwqLinearOps, QuantMethod.FP8_BLOCK: Fp8BlockLinearOps}


class CpuLinears:
    """Serves every scheme; one bound op set per scheme, shared by all linears of that scheme."""

    def __init__(self, fused: CpuFusedOps) -> None:
        self._fused = fused
        self._bound: dict[QuantScheme, LinearOps] = {}

    def bind(self, scheme: QuantScheme) -> LinearOps:
        if scheme not in self._bound:
            self._bound[scheme] = _OPS[scheme.method](self._fused, scheme)
        return self._bound[scheme]
