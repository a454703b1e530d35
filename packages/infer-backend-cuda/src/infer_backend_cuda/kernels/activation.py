"""SiLU-and-mul: `[T, 2I]` -> `silu(gate) * up` `[T, I]` (gate is the first half).

Fuses the SiLU and the product so the `[T, 2I]` GEMM output is read once and only `[T, I]` is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch, rows_view


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, I, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: start early, read inputs only after the producer ends
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"last dimension must be even, got {two_i}")
    inter = two_i // 2
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    x2 = rows_view(gate_up)
    out2 = out.view(-1, inter)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out
    block = min(1024, next_pow2(inter))
    _silu_and_mul_kernel[(n_rows, triton.cdiv(inter, block))](
        x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 2,
        **pdl_launch(x2.device),
    )
    return out
