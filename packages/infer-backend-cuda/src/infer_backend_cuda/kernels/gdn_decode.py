"""A Gated DeltaNet layer's whole decode mixer in one kernel: causal conv1d + SiLU, the gates, the gated delta rule
and the gated RMSNorm, between the in_proj and out_proj GEMMs (every sequence exactly one new token).

At batch 1 the separate kernels (`causal_conv1d`, then the recurrence computing its gates, then `gated_rms_norm`)
each cost mostly their launch, their wait for the kernel before and their first loads; fused, a decode step
launches one kernel per layer instead of three.

Grid `(B, Hv, Dv / BV)`, as the recurrence's: one program per (sequence, value head, block of value columns) keeps
its `[Dk, BV]` slice of the fp32 state in registers (a state read and written once, spread over many SMs). Each
program convolves the q and k channels of its key head itself (a few KB, shared by the `GROUP · Dv / BV` programs
of that key head, and read by all of them) and the v channels of its own columns (read and rewritten by it
alone). Two things need the whole key head's group: the q / k conv state may be overwritten only after every
program of the group has read it, and the gated RMSNorm normalises a value head over all `Dv` columns. So each
program stores its rounded `o` slice, then counts itself in (one atomic on a per-(sequence, key head) counter,
released after all its stores); the program that arrives last shifts the q / k conv state, applies the gated
norm to the group's `o` in place and resets the counter, which leaves the counters zero for the next launch
without a memset. The roundings are those of the unfused chain: the conv output, the gated delta rule's output
and the norm's two intermediate products are rounded to the model dtype (qkv's), beta to b's. Rows come from
the device-side `cu_seqlens` and the grid from shapes only, so the launch is CUDA-graph capturable; padding rows
use slot 0 like any slot.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels import split_k
from infer_backend_cuda.kernels._common import next_pow2, pdl_launch
from infer_backend_cuda.kernels.gdn_gates import gate_values, gated_rms_norm_tile
from infer_backend_cuda.kernels.gdn_recurrent import delta_rule_step, l2_normalise, state_block_v


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
    """The shifted conv state of channels `ch` (old columns 1..K-2, then the new input x) in registers, to be
    stored once nothing reads the old state any more."""
    i = tl.arange(0, KP)
    last = (i == K - 2)[None, :]
    old = tl.load(s_ptr + ch[:, None] * s_sc + (i + 1)[None, :], mask=cm[:, None] & (i < K - 2)[None, :], other=0.0)
    return tl.where(last, x.to(s_ptr.dtype.element_ty)[:, None], old)


@triton.jit
def _store_state(new, s_ptr, ch, cm, s_sc, K: tl.constexpr, KP: tl.constexpr):
    i = tl.arange(0, KP)
    tl.store(s_ptr + ch[:, None] * s_sc + i[None, :], new, mask=cm[:, None] & (i < K - 1)[None, :])


@triton.jit
def _gdn_decode_kernel(
    qkv_ptr, z_ptr, b_ptr, a_ptr, w_ptr, alog_ptr, dtb_ptr, nw_ptr, conv_ptr, rec_ptr, out_ptr, cu_ptr, slot_ptr,
    arrive_ptr,
    x_st, z_st, b_st, a_st, o_st, w_sc, c_ss, c_sc, r_ss, r_sh, r_sk,
    HK, KEY_DIM, DK, DV, scale, eps,
    GROUP: tl.constexpr, GP: tl.constexpr, NVB: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // GROUP
    row = tl.load(cu_ptr + seq).to(tl.int64)  # a decode step: the sequence's one row
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    dt = qkv_ptr.dtype.element_ty  # the model dtype: the unfused chain's intermediate tensors
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    km = kk < DK
    vm = vv < DV
    # Before waiting for the in_proj GEMM (under PDL): the step's rows and slots (copied in before the step's first
    # kernel), the state tile (the bulk of the program's bytes; only this layer's kernel writes it, and its previous
    # launch ended steps ago) and the gate parameters. Everything the GEMM writes is read after the wait.
    s_ptrs = rec_ptr + slot * r_ss + h * r_sh + kk[:, None] * r_sk + vv[None, :]
    smask = km[:, None] & vm[None, :]
    state = tl.load(s_ptrs, mask=smask, other=0.0)
    a_log = tl.load(alog_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x_row = qkv_ptr + row * x_st
    c_base = conv_ptr + slot * c_ss
    q_ch = hk * DK + kk
    k_ch = KEY_DIM + q_ch
    v_ch = 2 * KEY_DIM + h * DV + vv
    q, xq = _conv_window(x_row, w_ptr, c_base, q_ch, km, w_sc, c_sc, K)
    k, xk = _conv_window(x_row, w_ptr, c_base, k_ch, km, w_sc, c_sc, K)
    v, xv = _conv_window(x_row, w_ptr, c_base, v_ch, vm, w_sc, c_sc, K)
    new_v = _shift_state(xv, c_base, v_ch, vm, c_sc, K, KP)
    # a and b before the first store: loads after a store may not be moved above it (they could alias), so here
    # they share the conv's round trip instead of taking one of their own.
    a = tl.load(a_ptr + row * a_st + h).to(tl.float32)
    b = tl.load(b_ptr + row * b_st + h).to(tl.float32)
    tl.debug_barrier()  # every thread has read these v channels' old state before any overwrites it
    _store_state(new_v, c_base, v_ch, vm, c_sc, K, KP)
    q = l2_normalise(q.to(dt).to(tl.float32)) * scale
    k = l2_normalise(k.to(dt).to(tl.float32))
    v = v.to(dt).to(tl.float32)
    g, beta = gate_values(a, b, a_log, dt_bias, b_ptr.dtype.element_ty)
    state, o = delta_rule_step(state, q, k, v, g, beta)
    tl.store(s_ptrs, state, mask=smask)
    o_row = out_ptr + row * o_st
    tl.store(o_row + h * DV + vv, o.to(out_ptr.dtype.element_ty), mask=vm)  # rounded, as `gdn_recurrent` stores it
    counter = arrive_ptr + seq * HK + hk
    if split_k.last_arrival(counter, GROUP * NVB):  # (its stores released first: `split_k.last_arrival`)
        # The group's last program: every other one has read the q / k conv state and stored its o slice.
        new_q = _shift_state(xq, c_base, q_ch, km, c_sc, K, KP)
        new_k = _shift_state(xk, c_base, k_ch, km, c_sc, K, KP)
        _store_state(new_q, c_base, q_ch, km, c_sc, K, KP)
        _store_state(new_k, c_base, k_ch, km, c_sc, K, KP)
        gi = tl.arange(0, GP)
        dd = tl.arange(0, BD)
        gmask = (gi < GROUP)[:, None] & (dd < DV)[None, :]
        cols = (hk * GROUP + gi)[:, None] * DV + dd[None, :]
        # From L2 (.cg): the other programs' slices were written on other SMs.
        o_all = tl.load(o_row + cols, mask=gmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        z = tl.load(z_ptr + row * z_st + cols, mask=gmask, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + dd, mask=dd < DV, other=0.0).to(tl.float32)
        y = gated_rms_norm_tile(o_all, z, nw[None, :], DV, eps, dt, 1)
        tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=gmask)
        tl.store(counter, 0)


def arrival_counters(n_seq: int, heads: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed counters for `gdn_decode` launches of up to `n_seq` sequences of up to `heads` key heads; each launch
    leaves them zero."""
    return torch.zeros(n_seq * heads, dtype=torch.int32, device=device)


# INFER_CUDA_GDN_BLOCK_V: value columns a program (a power of two; A/B runs), else `value_block`'s. Read once at import,
# like the other INFER_CUDA_ switches.
BLOCK_V_ENV = "INFER_CUDA_GDN_BLOCK_V"
_BLOCK_V = int(os.environ.get(BLOCK_V_ENV, "0") or 0)


def value_block(dk: int, dv: int) -> int:
    """Value columns a program takes: the override, else the recurrence's (`state_block_v`)."""
    return _BLOCK_V or state_block_v(dk, dv)


def gdn_decode(
    qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, heads: tuple[int, int, int, int],
    conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    conv_states: torch.Tensor, recurrent_states: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor,
    arrivals: torch.Tensor, block_v: int | None = None,
) -> torch.Tensor:
    """One decode step of a Gated DeltaNet layer's mixer, heads `(Hk, Dk, Hv, Dv)`: qkv `[T, 2·Hk·Dk + Hv·Dv]`, z
    `[T, Hv·Dv]`, b, a `[T, Hv]` (row-strided views of the fused in_proj output), conv weight `[C, K]`; sequence i's
    row is `cu_seqlens[i]` and its state `slot_ids[i]` of both pools, updated in place. `arrivals`: int32 counters,
    zero, at least `B · Hk` (`arrival_counters`; left zero). `block_v`: value columns a program (a power of two;
    `value_block` by default). Returns `[T, Hv·Dv]` in qkv's dtype."""
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
    n_seq = slot_ids.shape[0]
    if arrivals.dtype != torch.int32 or arrivals.numel() < n_seq * hk:
        raise ValueError(f"arrival counters: int32, at least {n_seq * hk}, got {arrivals.dtype} {arrivals.numel()}")
    out = torch.empty((t, hv * dv), dtype=qkv.dtype, device=qkv.device)
    if n_seq == 0:
        return out
    bk = next_pow2(dk)
    bv = block_v or value_block(dk, dv)
    nvb = triton.cdiv(dv, bv)
    _gdn_decode_kernel[(n_seq, hv, nvb)](
        qkv, z, b, a, conv_weight, a_log.contiguous(), dt_bias.contiguous(), norm_weight.contiguous(), conv_states,
        recurrent_states, out, cu_seqlens, slot_ids, arrivals,
        qkv.stride(0), z.stride(0), b.stride(0), a.stride(0), out.stride(0), conv_weight.stride(0),
        conv_states.stride(0), conv_states.stride(1), recurrent_states.stride(0), recurrent_states.stride(1),
        recurrent_states.stride(2), hk, hk * dk, dk, dv, float(dk) ** -0.5, float(eps),
        GROUP=hv // hk, GP=next_pow2(hv // hk), NVB=nvb, K=k, KP=next_pow2(k - 1), BK=bk, BV=bv,
        BD=next_pow2(dv), num_warps=4, **pdl_launch(qkv.device),
    )
    return out
