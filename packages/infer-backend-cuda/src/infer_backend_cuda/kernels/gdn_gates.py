"""The two elementwise kernels around a Gated DeltaNet layer's recurrence.

- `gated_rms_norm`: transformers' `Qwen3_5RMSNormGated`, `(w * rms_norm(x)) * silu(gate)` per row, with the same
  roundings (normed row to x's dtype, then times w, then times the fp32 SiLU of the gate).
- `gdn_gates`: the decay and the update strength from the `in_proj_a` / `in_proj_b` outputs,
  `g = -exp(A_log) * softplus(a + dt_bias)` and `beta = sigmoid(b)` (rounded to b's dtype, as the unfused
  op stores it), both fp32.

Both take a `[rows, cols]` tile per program, so the many short rows (one per token and value head) of a step
share a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch, rows_view


@triton.jit(do_not_specialize=("N",))  # N: the step's tokens x heads
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, x_st, z_st, o_st, N, D, eps,
    BR: tl.constexpr, BD: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BD)
    cm = cols < D
    mask = (rows < N)[:, None] & cm[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_st + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows[:, None] * z_st + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    y = gated_rms_norm_tile(x, z, w[None, :], D, eps, out_ptr.dtype.element_ty, 1)
    tl.store(out_ptr + rows[:, None] * o_st + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_rms_norm_tile(x, z, w, D, eps, dt: tl.constexpr, AXIS: tl.constexpr):
    """`Qwen3_5RMSNormGated` of fp32 rows x (over `AXIS`, D valid entries, zeros past them) with fp32 gates z and
    weight w, its two intermediate products rounded to `dt` (the output dtype); returns fp32."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) / D + eps)
    normed = (x * rstd).to(dt).to(tl.float32)
    scaled = (normed * w).to(dt).to(tl.float32)
    return scaled * (z / (1.0 + tl.exp(-z)))


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`(weight * rms_norm(x)) * silu(gate)` over the last dim, in x's dtype (x, gate `[..., D]`, weight `[D]`)."""
    if x.shape != gate.shape or weight.shape != x.shape[-1:] or weight.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, z2 = rows_view(x), rows_view(gate)
    out2 = out.view(-1, x.shape[-1])
    n, d = x2.shape
    if n == 0:
        return out
    bd = next_pow2(d)
    br = max(1, min(next_pow2(n), 4096 // bd))
    _gated_rms_norm_kernel[(triton.cdiv(n, br),)](
        x2, z2, weight, out2, x2.stride(0), z2.stride(0), out2.stride(0), n, d, float(eps),
        BR=br, BD=bd, num_warps=4, **pdl_launch(x.device),
    )
    return out


@triton.jit(do_not_specialize=("T",))  # T: the step's tokens
def _gdn_gates_kernel(
    a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, a_st, b_st, o_st, T, H,
    BT: tl.constexpr, BH: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    cols = tl.arange(0, BH)
    hm = cols < H
    mask = (rows < T)[:, None] & hm[None, :]
    a = tl.load(a_ptr + rows[:, None] * a_st + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * b_st + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + cols, mask=hm, other=0.0).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + cols, mask=hm, other=0.0).to(tl.float32)
    g, beta = gate_values(a, b, a_log[None, :], dt_bias[None, :], b_ptr.dtype.element_ty)
    offs = rows[:, None] * o_st + cols[None, :]
    tl.store(g_ptr + offs, g, mask=mask)
    tl.store(beta_ptr + offs, beta, mask=mask)


@triton.jit
def gate_values(a, b, a_log, dt_bias, b_dtype: tl.constexpr):
    """`(g, beta)` in fp32 from fp32 a, b, A_log, dt_bias (any broadcastable shapes), beta rounded to `b_dtype`."""
    xs = a + dt_bias
    # torch's softplus: linear above 20; log1p(exp(x)), which is exp(x) to fp32 precision far below 0.
    ex = tl.exp(tl.minimum(xs, 20.0))
    softplus = tl.where(xs > 20.0, xs, tl.where(xs < -15.0, ex, tl.log(1.0 + ex)))
    g = -tl.exp(a_log) * softplus
    return g, (1.0 / (1.0 + tl.exp(-b))).to(b_dtype).to(tl.float32)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(g, beta)` `[T, H]` fp32 from a, b `[T, H]` (row-strided views allowed), A_log and dt_bias `[H]`."""
    if a.shape != b.shape or a.dim() != 2 or a_log.shape != a.shape[1:] or dt_bias.shape != a.shape[1:]:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(a_log.shape)}, "
                         f"dt_bias {tuple(dt_bias.shape)}")
    a2, b2 = rows_view(a), rows_view(b)
    t, h = a2.shape
    g = torch.empty((t, h), dtype=torch.float32, device=a.device)
    beta = torch.empty((t, h), dtype=torch.float32, device=a.device)
    if t == 0:
        return g, beta
    bh = next_pow2(h)
    bt = max(1, min(next_pow2(t), 2048 // bh))
    _gdn_gates_kernel[(triton.cdiv(t, bt),)](
        a2, b2, a_log.contiguous(), dt_bias.contiguous(), g, beta, a2.stride(0), b2.stride(0), g.stride(0), t, h,
        BT=bt, BH=bh, num_warps=4, **pdl_launch(a.device),
    )
    return g, beta
