"""The GEMM-bearing ops of one weight scheme (dense, AWQ, block FP8), bound once per linear when a model is built.

A linear's weight is the tuple of its scheme's operands, in `QuantScheme.checkpoint_names` order, plus for block
FP8 a derived third operand `scale_row` (int32 `[out]`: which row of `weight_scale_inv` scales each output row).
That index lets fused projections (qkv, gate_up) keep each part's partial edge block of scales: parts whose out is
no multiple of the block size concatenate their scale rows, and no block straddles two parts.
"""

from __future__ import annotations

from typing import Protocol, Sequence

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

    def silu_mul_linear(self, gate_up: Tensor, weight: Sequence[Tensor], bias: Tensor | None) -> Tensor:
        """`FusedOps.silu_mul_linear` with this scheme's GEMM."""
        ...


class LinearOpsFactory(Protocol):
    def bind(self, scheme: QuantScheme) -> LinearOps:
        """The ops for weights of `scheme`; raises ValueError for a scheme this backend cannot run."""
        ...
