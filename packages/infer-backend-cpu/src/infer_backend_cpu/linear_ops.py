"""The CPU backend's `LinearOps` per weight scheme: dense torch GEMMs, and the quantized layouts' reference
numerics (`quant_math.py`) composed with the reference norm and activation (unfused)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from infer_backend_cpu.fused_ops import CpuFusedOps
from infer_backend_cpu.quant_math import awq_dequantize, fp8_block_linear, fp8_grouped_codes
from infer_core.ports.linear_ops import LinearOps, UnfusedLinearOps
from infer_core.quant import QuantMethod, QuantScheme

Operands = Sequence[torch.Tensor]


class DenseLinearOps(UnfusedLinearOps):
    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight[0], bias)


class _Expanded:
    """Per weight, the fp32 tensor the reference GEMM reads, built on first use and rebuilt when a loader writes
    the weight again (torch's version counter, which views share with their base, moves on every in-place write).
    Rebuilding it per call would make the reference too slow to serve a real model (seconds per step)."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}

    def get(self, operands: Operands, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = operands[0].data_ptr()
        versions = tuple(t._version for t in operands)
        hit = self._cache.get(key)
        if hit is None or hit[0] != versions:
            hit = (versions, build())
            self._cache[key] = hit
        return hit[1]


class AwqLinearOps(UnfusedLinearOps):
    def __init__(self, fused: CpuFusedOps, scheme: QuantScheme) -> None:
        super().__init__(fused, scheme)
        self._dense = _Expanded()

    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, qzeros, scales = weight
        # As an `[out, in]` weight, so the GEMM is the one a dense twin of the checkpoint runs.
        dense = self._dense.get(weight, lambda: awq_dequantize(qweight, qzeros, scales).t().contiguous())
        return F.linear(x, dense.to(x.dtype), bias)


class Fp8BlockLinearOps(UnfusedLinearOps):
    def __init__(self, fused: CpuFusedOps, scheme: QuantScheme) -> None:
        super().__init__(fused, scheme)
        self._codes = _Expanded()

    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        codes, scale_inv, scale_row = weight
        group = self.scheme.block[1]
        grouped = self._codes.get((codes,), lambda: fp8_grouped_codes(codes, group))
        return fp8_block_linear(x, codes, scale_inv, scale_row, group, bias, grouped)


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
