"""The CUDA adapter's `LinearOps` per weight scheme, bound once per scheme when the model is built.

Dense weights take cuBLAS, the skinny Triton GEMM at 1-8 rows (with its fused norm prologue, and the gate / up
GEMM's SiLU-and-mul epilogue) or the mid Triton GEMM at 9-128 rows (with that epilogue too) where the GPU's tables say
so. AWQ and block FP8 run their Triton GEMMs (`kernels/awq_gemm.py`, `kernels/fp8_gemm.py`) after the unfused norm
kernel; the gate / up GEMM applies the SiLU-and-mul itself where it pays (AWQ's tiled kernel, 2 rows and more: the
last program of each output tile, `awq_linear_silu_mul`; block FP8: the mid GEMM's epilogue where its table has the
FP8 entry, 1-128 rows), else the SiLU-and-mul kernel runs after it. Every path allocates its outputs with
`torch.empty` only, which a CUDA-graph capture serves from the graph's pool, and never synchronises with the host.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from infer_backend_cuda.kernels import awq_gemm, fp8_gemm
from infer_backend_cuda.kernels import mid_gemm as mid
from infer_backend_cuda.kernels import skinny_gemm as skinny
from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
from infer_core.ports.fused_ops import unfused_add_rms_norm_linear
from infer_core.ports.linear_ops import LinearOps, UnfusedLinearOps
from infer_core.quant import QuantMethod, QuantScheme

Operands = Sequence[torch.Tensor]
# INFER_CUDA_FP8_NORM_QUANT=1: the RMSNorm before an FP8 GEMM done by its activation quantization pass, one launch
# fewer a GEMM (72 a Qwen3-4B step), the same bits; off: slower at 1-64 rows on an H100, not yet measured on the H200
# (docs/benchmarks.md). Read once at import, like the other INFER_CUDA_ switches.
FP8_NORM_QUANT_ENV = "INFER_CUDA_FP8_NORM_QUANT"
FP8_NORM_QUANT = os.environ.get(FP8_NORM_QUANT_ENV, "0").strip() == "1"


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

    def add_rms_norm_linear_silu_mul(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: Operands, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm kernel, then at decode sizes the gate / up GEMM with SiLU-and-mul in its epilogue: the skinny GEMM
        with the plain GEMM's config at this shape (`INFER_CUDA_GATED_GEMM=0`: the GEMM, then the SiLU-and-mul
        kernel), or the mid GEMM where its table has a gated entry (9-128 rows)."""
        return unfused_add_rms_norm_linear(self._fused, self._gated_linear, x, residual, norm_weight, eps, weight[0],
                                           bias)

    def _gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        config = self._math.triton_gemm_config("linear_silu_mul", x, weight)
        if isinstance(config, mid.MidConfig):
            return mid.mid_linear_silu_mul(x, weight, bias, config=config)
        if config is not None and skinny.GATED:
            return skinny.skinny_linear_silu_mul(x, weight, bias, config=config)
        return self._fused.silu_and_mul(self._math.linear_with(config, x, weight, bias))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Inputs of any leading shape, as F.linear takes them, as the kernels see them: `[rows, in]`, rows contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _QuantizedLinearOps(UnfusedLinearOps):
    """A quantized scheme's GEMM with the norm kernel before it; the gate / up GEMM's SiLU-and-mul where the scheme
    fuses it (`gated_gemm`), else its kernel after the GEMM."""

    def gemm(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def gated_gemm(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        """`silu_and_mul(gemm(x, [gate | up]))` for `x [M, K]`; a scheme with a fused epilogue overrides it."""
        return self._fused.silu_and_mul(self.gemm(x, weight, bias))

    def linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemm(_rows(x), weight, bias).reshape(*x.shape[:-1], -1)

    def add_rms_norm_linear_silu_mul(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: Operands, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return unfused_add_rms_norm_linear(self._fused, self._gated_linear, x, residual, norm_weight, eps, weight,
                                           bias)

    def _gated_linear(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gated_gemm(_rows(x), weight, bias).reshape(*x.shape[:-1], -1)


class AwqLinearOps(_QuantizedLinearOps):
    def __init__(self, fused: TritonFusedOps, scheme: QuantScheme) -> None:
        awq_gemm.check_group(scheme.group_size)
        super().__init__(fused, scheme)

    def gemm(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, qzeros, scales = weight
        return awq_gemm.awq_linear(x, qweight, qzeros, scales, bias)

    def gated_gemm(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        """The gate / up GEMM whose last program of each tile writes the activation (`awq_linear_silu_mul`)."""
        qweight, qzeros, scales = weight
        return awq_gemm.awq_linear_silu_mul(x, qweight, qzeros, scales, bias)


class Fp8BlockLinearOps(_QuantizedLinearOps):
    """The block-FP8 GEMMs. With `INFER_CUDA_FP8_NORM_QUANT=1` the (add +) RMSNorm before one is done by its
    activation quantization pass (`fp8_gemm.NormPrologue`: one launch and the normed activation's round trip fewer a
    GEMM); by default the norm kernel runs, then the GEMM."""

    def gemm(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None,
             norm: fp8_gemm.NormPrologue | None = None) -> torch.Tensor:
        codes, scale_inv, scale_row = weight
        return fp8_gemm.fp8_block_linear(x, codes, scale_inv, scale_row, self.scheme.block[1], bias, norm=norm)

    def add_rms_norm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: Operands, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = x.shape[-1]
        if not (FP8_NORM_QUANT and fp8_gemm.norm_quant_fits(hidden, self.scheme.block[1])):
            return super().add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
        rows = _rows(x)
        stream = x if residual is None else torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
        norm = fp8_gemm.NormPrologue(residual, norm_weight, eps, stream if residual is not None else None)
        out = self.gemm(rows, weight, bias, norm)
        return out.reshape(*x.shape[:-1], -1), stream

    def add_rms_norm_linear_silu_mul(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: Operands, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm kernel, then the gate / up GEMM with SiLU-and-mul in the mid GEMM's epilogue where the mid table
        has the shape (else the GEMM and the SiLU-and-mul kernel); with the norm in the quantization pass, unfused."""
        if FP8_NORM_QUANT:
            return UnfusedLinearOps.add_rms_norm_linear_silu_mul(self, x, residual, norm_weight, eps, weight, bias)
        return super().add_rms_norm_linear_silu_mul(x, residual, norm_weight, eps, weight, bias)

    def gated_gemm(self, x: torch.Tensor, weight: Operands, bias: torch.Tensor | None) -> torch.Tensor:
        codes, scale_inv, scale_row = weight
        return fp8_gemm.fp8_block_linear_silu_mul(x, codes, scale_inv, scale_row, self.scheme.block[1], bias)


class CudaLinears:
    def __init__(self, math: CudaMathOps, fused: TritonFusedOps) -> None:
        self._math = math
        self._fused = fused
        self._bound: dict[QuantScheme, LinearOps] = {}

    def bind(self, scheme: QuantScheme) -> LinearOps:
        if scheme not in self._bound:
            if scheme.method is QuantMethod.DENSE:
                self._bound[scheme] = DenseLinearOps(self._math, self._fused, scheme)
            elif scheme.method is QuantMethod.AWQ:
                self._bound[scheme] = AwqLinearOps(self._fused, scheme)
            else:
                self._bound[scheme] = Fp8BlockLinearOps(self._fused, scheme)
        return self._bound[scheme]
