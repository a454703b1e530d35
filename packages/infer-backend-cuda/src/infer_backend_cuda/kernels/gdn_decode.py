"""A Gated DeltaNet layer's whole decode mixer in one kernel: causal conv1d + SiLU, the gates, the gated delta rule
and the gated RMSNorm, between the in_proj and out_proj GEMMs (every sequence exactly one new token).

At batch 1 the four separate kernels (`causal_conv1d`, `gdn_gates`, `gdn_recurrent`, `gated_rms_norm`) each cost
mostly their fixed launch and ramp time; fused, a decode step launches one kernel per layer instead of four.

Grid `(B, Hk)`: one program per (sequence, key head) owns the conv channels of its key head's q and k and of the
`GROUP = Hv / Hk` value heads that read that key head, so each conv state entry is read and rewritten by one
program only (behind a barrier after all its reads, as in `causal_conv1d`); the value heads of the group run one
after the other, each with its whole `[Dk, Dv]` fp32 state tile. The roundings are those of the unfused chain: the
conv output, the gated delta rule's output and the norm's two intermediate products are rounded to the model
dtype (qkv's), beta to b's. Rows come from the device-side `cu_seqlens` and the grid from shapes only, so the
launch is CUDA-graph capturable; padding rows use slot 0 like any slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch
from infer_backend_cuda.kernels.gdn_gates import gate_values, gated_rms_norm_tile
from infer_backend_cuda.kernels.gdn_recurrent import delta_rule_step, l2_normalise

@triton.jit
def _conv_window(x_row_ptr, w_ptr, s_ptr, ch, cm, w_sc, s_sc, K: tl.constexpr):
    """SiLU of the causal conv of one new input row over channels `ch` (fp32), and that row: the `K - 1` state
    columns (oldest first) and the new input, each tap in fp32 as `causal_conv1d` computes it."""
    x = tl.load(x_row_ptr + ch, mask=cm, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + ch * w_sc + (K - 1), mask=cm, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):
        sv = tl.load(s_ptr + ch * s_sc + j, mask=cm, other=0.0).to(tl.float32)
        acc += sv * tl.load(w_ptr + ch * w_sc + j, mask=cm, other=0.0).to(tl.float32)
    return acc / (1.0 + tl.exp(-acc)), x


@triton.jit
def _shift_state(x, s_ptr, ch, cm, s_sc, K: tl.constexpr, KP: tl.constexpr):
    """The shifted state of channels `ch` (old columns 1..K-2, then the new input x), still in registers: it is
    stored only after the barrier that follows every read of the old state."""
    i = tl.arange(0, KP)
    last = (i == K - 2)[None, :]
    old = tl.load(s_ptr + ch[:, None] * s_sc + (i + 1)[None, :], mask=cm[:, None] & (i < K - 2)[None, :], other=0.0)
    return tl.where(last, x.to(s_ptr.dtype.element_ty)[:, None], old)


@triton.jit
def _gdn_decode_kernel(
    qkv_ptr, z_ptr, b_ptr, a_ptr, w_ptr, alog_ptr, dtb_ptr, nw_ptr, conv_ptr, rec_ptr, out_ptr, cu_ptr, slot_ptr,
    x_st, z_st, b_st, a_st, o_st, w_sc, c_ss, c_sc, r_ss, r_sh, r_sk,
    KEY_DIM, DK, DV, scale, eps,
    GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    hk = tl.program_id(1)
    row = tl.load(cu_ptr + seq).to(tl.int64)  # a decode step: the sequence's one row
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    dt = qkv_ptr.dtype.element_ty  # the model dtype: the unfused chain's intermediate tensors
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    km = kk < DK
    vm = vv < DV
    x_row = qkv_ptr + row * x_st
    c_base = conv_ptr + slot * c_ss
    q_ch = hk * DK + kk
    k_ch = KEY_DIM + q_ch
    q, xq = _conv_window(x_row, w_ptr, c_base, q_ch, km, w_sc, c_sc, K)
    k, xk = _conv_window(x_row, w_ptr, c_base, k_ch, km, w_sc, c_sc, K)
    new_q = _shift_state(xq, c_base, q_ch, km, c_sc, K, KP)
    new_k = _shift_state(xk, c_base, k_ch, km, c_sc, K, KP)
    q = l2_normalise(q.to(dt).to(tl.float32)) * scale
    k = l2_normalise(k.to(dt).to(tl.float32))
    nw = tl.load(nw_ptr + vv, mask=vm, other=0.0).to(tl.float32)
    ip = tl.arange(0, KP)
    s_cols = (ip < K - 1)[None, :]
    for gi in tl.static_range(GROUP):
        h = hk * GROUP + gi
        # The state tile's load first: its latency (the bulk of the head's bytes) overlaps the conv's.
        s_ptrs = rec_ptr + slot * r_ss + h * r_sh + kk[:, None] * r_sk + vv[None, :]
        smask = km[:, None] & vm[None, :]
        state = tl.load(s_ptrs, mask=smask, other=0.0)
        v_ch = 2 * KEY_DIM + h * DV + vv
        v, xv = _conv_window(x_row, w_ptr, c_base, v_ch, vm, w_sc, c_sc, K)
        new_v = _shift_state(xv, c_base, v_ch, vm, c_sc, K, KP)
        tl.debug_barrier()  # every thread has read these channels' old state before any overwrites it
        if gi == 0:  # q and k were read before the loop
            tl.store(c_base + q_ch[:, None] * c_sc + ip[None, :], new_q, mask=km[:, None] & s_cols)
            tl.store(c_base + k_ch[:, None] * c_sc + ip[None, :], new_k, mask=km[:, None] & s_cols)
        tl.store(c_base + v_ch[:, None] * c_sc + ip[None, :], new_v, mask=vm[:, None] & s_cols)
        v = v.to(dt).to(tl.float32)
        # The unfused kernels' math: the gates, one token of the gated delta rule, the gated RMSNorm of o (first
        # rounded, as `gdn_recurrent` stores it).
        a = tl.load(a_ptr + row * a_st + h).to(tl.float32)
        b = tl.load(b_ptr + row * b_st + h).to(tl.float32)
        g, beta = gate_values(a, b, tl.load(alog_ptr + h).to(tl.float32), tl.load(dtb_ptr + h).to(tl.float32),
                              b_ptr.dtype.element_ty)
        state, o = delta_rule_step(state, q, k, v, g, beta)
        tl.store(s_ptrs, state, mask=smask)
        z = tl.load(z_ptr + row * z_st + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
        y = gated_rms_norm_tile(o.to(dt).to(tl.float32), z, nw, DV, eps, dt, 0)
        tl.store(out_ptr + row * o_st + h * DV + vv, y.to(out_ptr.dtype.element_ty), mask=vm)


def gdn_decode(
    qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, heads: tuple[int, int, int, int],
    conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    conv_states: torch.Tensor, recurrent_states: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor,
) -> torch.Tensor:
    """One decode step of a Gated DeltaNet layer's mixer, heads `(Hk, Dk, Hv, Dv)`: qkv `[T, 2·Hk·Dk + Hv·Dv]`, z `[T, Hv·Dv]`, b, a
    `[T, Hv]` (row-strided views of the fused in_proj output), conv weight `[C, K]`; sequence i's row is
    `cu_seqlens[i]` and its state `slot_ids[i]` of both pools, updated in place. Returns `[T, Hv·Dv]` in qkv's
    dtype."""
    hk, dk, hv, dv = heads
    t, c = qkv.shape
    k = conv_weight.shape[1]
    if hv % hk:
        raise ValueError(f"value heads {hv} are no multiple of key heads {hk}")
    if c != 2 * hk * dk + hv * dv or conv_weight.shape[0] != c or tuple(conv_states.shape[1:]) != (c, k - 1):
        raise ValueError(f"qkv {tuple(qkv.shape)}, conv weight {tuple(conv_weight.shape)}, conv states "
                         f"{tuple(conv_states.shape)} disagree with heads {tuple(heads)}")
    if k < 2:
        raise ValueError(f"a conv kernel of {k} keeps no state")
    if z.shape != (t, hv * dv) or b.shape != (t, hv) or a.shape != (t, hv) or norm_weight.shape != (dv,):
        raise ValueError(f"z {tuple(z.shape)}, b {tuple(b.shape)}, a {tuple(a.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)} disagree with heads {tuple(heads)}")
    if recurrent_states.dtype != torch.float32 or tuple(recurrent_states.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"recurrent states must be fp32 [S, {hv}, {dk}, {dv}]")
    for name, x in (("qkv", qkv), ("z", z), ("b", b), ("a", a), ("conv weight", conv_weight),
                    ("conv states", conv_states), ("recurrent states", recurrent_states)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous")
    if cu_seqlens.shape[0] != slot_ids.shape[0] + 1:
        raise ValueError("cu_seqlens must hold one more entry than slot_ids")
    out = torch.empty((t, hv * dv), dtype=qkv.dtype, device=qkv.device)
    n_seq = slot_ids.shape[0]
    if n_seq == 0:
        return out
    bk, bv = next_pow2(dk), next_pow2(dv)
    # A 128 x 128 fp32 state tile is 64 values a thread at 8 warps.
    _gdn_decode_kernel[(n_seq, hk)](
        qkv, z, b, a, conv_weight, a_log.contiguous(), dt_bias.contiguous(), norm_weight.contiguous(), conv_states,
        recurrent_states, out, cu_seqlens, slot_ids,
        qkv.stride(0), z.stride(0), b.stride(0), a.stride(0), out.stride(0), conv_weight.stride(0),
        conv_states.stride(0), conv_states.stride(1), recurrent_states.stride(0), recurrent_states.stride(1),
        recurrent_states.stride(2), hk * dk, dk, dv, float(dk) ** -0.5, float(eps),
        GROUP=hv // hk, K=k, KP=next_pow2(k - 1), BK=bk, BV=bv, num_warps=8 if bk * bv >= 8192 else 4,
        **pdl_launch(qkv.device),
    )
    return out
