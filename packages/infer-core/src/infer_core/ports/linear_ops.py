"""The GEMM-bearing ops of one weight scheme (dense, AWQ, block FP8), bound once per linear when a model is built.

A linear's weight is the tuple of its scheme's operands, in `QuantScheme.checkpoint_names` order, plus for block
FP8 a derived third operand `scale_row` (int32 `[out]`: which row of `weight_scale_inv` scales each output row).
That index lets fused projections (qkv, gate_up) keep each part's partial edge block of scales: parts whose out is
no multiple of the block size concatenate their scale rows, and no block straddles two parts.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from infer_core.ports.fused_ops import FusedOps, unfused_add_rms_norm_linear
from infer_core.ports.tensor import Tensor
from infer_core.quant import QuantScheme


class LinearOps(Protocol):
    scheme: QuantScheme

    def linear(self, x: Tensor, weight: Sequence[Tensor], bias: Tensor | None) -> Tensor:
        """`x [T, in] -> [T, out]` in x's dtype: `x @ W.T (+ bias)` with W the scheme's dequantized `[out, in]`."""
        ...

    def add_rms_norm_linear(
        self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Sequence[Tensor],
        bias: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """`FusedOps.add_rms_norm_linear` with this scheme's GEMM."""
        ...

    def add_rms_norm_linear_silu_mul(
        self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Sequence[Tensor],
        bias: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """`(silu_and_mul(out), h)` for `(out, h) = add_rms_norm_linear(...)` of a `[gate | up]` weight: a gated MLP's
        norm, gate / up GEMM and activation as one op, so that an adapter can apply the activation in the GEMM's
        epilogue (decode sizes) instead of a launch of its own."""
        ...


class LinearOpsFactory(Protocol):
    def bind(self, scheme: QuantScheme) -> LinearOps:
        """The ops for weights of `scheme`; raises ValueError for a scheme this backend cannot run."""
        ...


class UnfusedLinearOps:
    """A scheme's `LinearOps` whose norm + GEMM (+ SiLU-and-mul) are the separate ops around its `linear`: what an
    adapter binds for a layout it has no fused kernel for."""

    def __init__(self, fused: FusedOps, scheme: QuantScheme) -> None:
        self._fused = fused
        self.scheme = scheme

    def linear(self, x: Tensor, weight: Sequence[Tensor], bias: Tensor | None) -> Tensor:
        raise NotImplementedError

    def add_rms_norm_linear(
        self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Sequence[Tensor],
        bias: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        return unfused_add_rms_norm_linear(self._fused, self.linear, x, residual, norm_weight, eps, weight, bias)

    def add_rms_norm_linear_silu_mul(
        self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Sequence[Tensor],
        bias: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        out, h = self.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
        return self._fused.silu_and_mul(out), h
