"""SiLU-and-mul: `[T, 2I]` -> `silu(gate) * up` `[T, I]` (gate is the first half).

Fuses the SiLU and the product so the `[T, 2I]` GEMM output is read once and only `[T, I]` is written.

Sigmoid-gate-mul: `x * sigmoid(gate)` (a gated attention's output gate, Qwen3.5), one launch under PDL where torch
took two (the sigmoid, the product), with the gate read in place from its strided view of the q projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch, rows_view


@triton.jit
def silu_mul(gate, up):
    """`silu(gate) * up` in fp32, the one formula of every SiLU-and-mul (this kernel, the GEMMs' gated epilogues)."""
    return gate / (1.0 + tl.exp(-gate)) * up


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
    tl.store(out_ptr + row * out_stride + cols, silu_mul(g, u).to(out_ptr.dtype.element_ty), mask=mask)


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


@triton.jit
def _sigmoid_gate_mul_kernel(x_ptr, g_ptr, out_ptr, x_s0, x_s1, g_s0, g_s1, o_s0, o_s1, H, D,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """One token's `[H, D]` per program. Rounded as torch's two bf16 ops: the sigmoid to x's dtype, then the product."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    g = tl.load(g_ptr + row * g_s0 + h * g_s1 + d, mask=mask, other=0.0)
    x = tl.load(x_ptr + row * x_s0 + h * x_s1 + d, mask=mask, other=0.0)
    tl.store(out_ptr + row * o_s0 + h * o_s1 + d, sigmoid_gated(x, g, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sigmoid_gated(x, g, dt: tl.constexpr):
    """`x * sigmoid(g)` in `dt`, rounded as torch's two ops round: the sigmoid (fp32) to x's dtype, then the product
    (the decode attention applies the output gate with it too)."""
    s = tl.sigmoid(g.to(tl.float32)).to(x.dtype).to(tl.float32)
    return (x.to(tl.float32) * s).to(dt)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x * sigmoid(gate)` for `x, gate [T, H, D]` (any row / head strides, last dim contiguous)."""
    if x.dim() != 3 or gate.shape != x.shape:
        raise ValueError(f"sigmoid_gate_mul: x {tuple(x.shape)} and gate {tuple(gate.shape)} must be equal [T, H, D]")
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("sigmoid_gate_mul: the last dimension of x and gate must be contiguous")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_tok, heads, dim = x.shape
    if n_tok == 0:
        return out
    block = next_pow2(heads) * next_pow2(dim)
    _sigmoid_gate_mul_kernel[(n_tok,)](
        x, gate, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), out.stride(0), out.stride(1),
        heads, dim, BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(dim), num_warps=8 if block >= 4096 else 4,
        **pdl_launch(x.device),
    )
    return out
