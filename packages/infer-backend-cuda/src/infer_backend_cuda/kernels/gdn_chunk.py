"""Chunked gated delta rule (the WY form, chunks of 64 tokens) over a ragged batch with state slots (prefill).

One program per (sequence, value head, block of value columns) walks the sequence's chunks, carrying its
`[Dk, BV]` slice of the fp32 state in registers from the slot and back. Per chunk, with `G` the in-chunk
cumulative log decay, `kb = beta * k` and `M = strict_lower(kb k^T * exp(G_i - G_j))`:

    T = (I + M)^-1                      (forward substitution, row by row)
    u = T (beta * v),  w = T (kb * exp(G))
    v' = u - w S
    o = (q * exp(G)) S + lower(q k^T * exp(G_i - G_j)) v'
    S = exp(G_last) S + (k * exp(G_last - G))^T v'

which is transformers' `torch_chunk_gated_delta_rule` (q, k L2-normalised and q scaled inside). Everything is
fp32 and every product an IEEE fp32 `tl.dot`, so the result equals the per-token recurrence up to fp32
rounding. Tokens past a sequence's end load as zeros (k = v = beta = g = 0), which leaves the state unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch
from infer_backend_cuda.kernels.gdn_recurrent import gdn_kernel_args, prepare_gdn_out, sequence_head_block

CHUNK = 64


@triton.jit
def _gdn_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, g_st, beta_st, o_st, o_sh,
    s_ss, s_sh, s_sk,
    DK, DV, GROUP, scale,
    CH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    hk, h, bos, n, kk, vv, km, vm, s_ptrs, smask = sequence_head_block(
        cu_ptr, slot_ptr, state_ptr, s_ss, s_sh, s_sk, DK, DV, GROUP, BK, BV
    )
    ci = tl.arange(0, CH)
    lower_strict = ci[:, None] > ci[None, :]
    lower = ci[:, None] >= ci[None, :]
    state = tl.load(s_ptrs, mask=smask, other=0.0)
    for c0 in range(0, n, CH):
        rows = bos + c0 + ci
        tm = (c0 + ci) < n
        qkm = tm[:, None] & km[None, :]
        q = tl.load(q_ptr + rows[:, None] * q_st + hk * q_sh + kk[None, :], mask=qkm, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * k_st + hk * k_sh + kk[None, :], mask=qkm, other=0.0).to(tl.float32)
        vmask = tm[:, None] & vm[None, :]
        v = tl.load(v_ptr + rows[:, None] * v_st + h * v_sh + vv[None, :], mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows * g_st + h, mask=tm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * beta_st + h, mask=tm, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        gc = tl.cumsum(g, axis=0)
        decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
        kb = k * beta[:, None]
        m = tl.where(lower_strict, tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)
        # T = (I + M)^-1 by forward substitution: row i of T is e_i - M[i, :i] T[:i, :].
        t_inv = tl.zeros((CH, CH), dtype=tl.float32)
        for i in range(0, CH):
            m_row = tl.sum(tl.where(ci[:, None] == i, m, 0.0), axis=0)
            row = tl.where(ci == i, 1.0, 0.0) - tl.sum(m_row[:, None] * t_inv, axis=0)
            t_inv = tl.where(ci[:, None] == i, row[None, :], t_inv)
        u = tl.dot(t_inv, v * beta[:, None], input_precision="ieee")
        w = tl.dot(t_inv, kb * tl.exp(gc)[:, None], input_precision="ieee")
        v_new = u - tl.dot(w, state, input_precision="ieee")
        qk = tl.where(lower, tl.dot(q, tl.trans(k), input_precision="ieee") * decay, 0.0)
        o = tl.dot(q * tl.exp(gc)[:, None], state, input_precision="ieee")
        o += tl.dot(qk, v_new, input_precision="ieee")
        tl.store(out_ptr + rows[:, None] * o_st + h * o_sh + vv[None, :], o.to(out_ptr.dtype.element_ty), mask=vmask)
        g_last = tl.sum(tl.where(ci == CH - 1, gc, 0.0), axis=0)
        k_end = k * tl.exp(g_last - gc)[:, None]
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k_end), v_new, input_precision="ieee")
    tl.store(s_ptrs, state, mask=smask)


def gdn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule in chunks of 64 tokens (same operands and result as `gdn_recurrent`)."""
    out = prepare_gdn_out(q, k, v, g, beta, states, cu_seqlens, slot_ids, out)
    n_seq, dk, hv, dv = slot_ids.shape[0], q.shape[2], v.shape[1], v.shape[2]
    if n_seq == 0 or q.shape[0] == 0:
        return out
    bk = max(16, next_pow2(dk))  # tl.dot needs every dimension >= 16
    bv = max(16, min(next_pow2(dv), 64))
    _gdn_chunk_kernel[(n_seq, hv, triton.cdiv(dv, bv))](
        *gdn_kernel_args(q, k, v, g, beta, states, out, cu_seqlens, slot_ids),
        CH=CHUNK, BK=bk, BV=bv, num_warps=8, **pdl_launch(q.device),
    )
    return out
