"""Fused recurrent gated delta rule over a ragged batch, state slots updated in place (the decode step).

One program per (sequence, value head, block of value columns) keeps its `[Dk, BV]` slice of the fp32 state in
registers and walks the sequence's tokens: per token it L2-normalises q and k (and scales q by `Dk ** -0.5`),
decays the state by `exp(g)`, applies the delta update `S += k (beta (v - k^T S))^T` and emits `o = q^T S`.
The state is read once and written once per call, so a decode step costs exactly its state bytes. Token ranges
come from the device-side `cu_seqlens` and the grid only from shapes, so the launch is CUDA-graph capturable.
In a mixed step it runs the short rows only (`max_len`; the programs of longer sequences exit at once) and
`gdn_chunk` the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch
from infer_backend_cuda.kernels.gdn_gates import gate_values


def state_block_v(dk: int, dv: int) -> int:
    """Value columns a program of the recurrence (and of the fused decode mixer) takes: a `[Dk, BV]` fp32 state tile
    of 4096 elements keeps one program within registers at Dk = 128."""
    return max(1, min(next_pow2(dv), 4096 // next_pow2(dk)))


@triton.jit
def sequence_head_block(
    cu_ptr, slot_ptr, state_ptr, s_ss, s_sh, s_sk, DK, DV, GROUP, BK: tl.constexpr, BV: tl.constexpr
):
    """This program's (sequence, value head, value block): its key head, token range, index vectors and the
    pointers / mask of its `[BK, BV]` state tile in the sequence's slot."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    n = tl.load(cu_ptr + seq + 1).to(tl.int64) - bos
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    km = kk < DK
    vm = vv < DV
    s_ptrs = state_ptr + slot * s_ss + h * s_sh + kk[:, None] * s_sk + vv[None, :]
    return h // GROUP, h, bos, n, kk, vv, km, vm, s_ptrs, km[:, None] & vm[None, :]


@triton.jit
def l2_normalise(x):
    """x (fp32, one row) over its L2 norm, eps 1e-6 as transformers' `l2norm` in the gated delta rule."""
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def delta_rule_step(state, q, k, v, g, beta):
    """One token of the gated delta rule on a `[Dk, BV]` fp32 state tile, q / k already normalised (q scaled):
    `S = S * exp(g)`, `S += k (beta (v - k^T S))^T`; returns the new tile and `o = q^T S`."""
    state = state * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


@triton.jit(do_not_specialize=("max_len",))
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr, alog_ptr, dtb_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, g_st, beta_st, o_st, o_sh,
    s_ss, s_sh, s_sk,
    DK, DV, GROUP, scale, max_len,
    BK: tl.constexpr, BV: tl.constexpr, GATES: tl.constexpr, USE_PDL: tl.constexpr,
):
    """With GATES, `g_ptr` / `beta_ptr` hold the raw `in_proj_a` / `in_proj_b` outputs and each program computes
    its head's decay and beta itself (`gdn_gates.gate_values`, the gates kernel's numerics: one launch fewer)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    hk, h, bos, n, kk, vv, km, vm, s_ptrs, smask = sequence_head_block(
        cu_ptr, slot_ptr, state_ptr, s_ss, s_sh, s_sk, DK, DV, GROUP, BK, BV
    )
    if n <= max_len:  # else a long row of a mixed step, which `gdn_chunk` runs
        state = tl.load(s_ptrs, mask=smask, other=0.0)
        for i in range(0, n):
            t64 = bos + i
            q = tl.load(q_ptr + t64 * q_st + hk * q_sh + kk, mask=km, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t64 * k_st + hk * k_sh + kk, mask=km, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + t64 * v_st + h * v_sh + vv, mask=vm, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + t64 * g_st + h).to(tl.float32)
            beta = tl.load(beta_ptr + t64 * beta_st + h).to(tl.float32)
            if GATES:
                g, beta = gate_values(g, beta, tl.load(alog_ptr + h).to(tl.float32),
                                      tl.load(dtb_ptr + h).to(tl.float32), beta_ptr.dtype.element_ty)
            state, o = delta_rule_step(state, l2_normalise(q) * scale, l2_normalise(k), v, g, beta)
            tl.store(out_ptr + t64 * o_st + h * o_sh + vv, o.to(out_ptr.dtype.element_ty), mask=vm)
        tl.store(s_ptrs, state, mask=smask)


def prepare_gdn_out(q, k, v, g, beta, states, cu_seqlens, slot_ids, out: torch.Tensor | None) -> torch.Tensor:
    """Checks the operands of a gated delta rule launch; returns the output buffer (`out` or a new one)."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != t or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
                         f"beta {tuple(beta.shape)} disagree")
    if hv % hk:
        raise ValueError(f"value heads {hv} are no multiple of key heads {hk}")
    if states.dtype != torch.float32 or tuple(states.shape[1:]) != (hv, dk, dv) or states.stride(-1) != 1:
        raise ValueError(f"recurrent states must be fp32 [S, {hv}, {dk}, {dv}] with a contiguous last dim")
    if cu_seqlens.shape[0] != slot_ids.shape[0] + 1:
        raise ValueError("cu_seqlens must hold one more entry than slot_ids")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous")
    return torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out


def gdn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor | None = None,
    max_len: int = 2**31 - 1, gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The gated delta rule token by token (q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g / beta `[T, Hv]`), starting
    from `states[slot_ids[i]]` and writing the final state back there, for the sequences of at most `max_len`
    tokens (the others' output rows and slots are left untouched). Returns `[T, Hv, Dv]` in v's dtype.
    With `gates = (A_log, dt_bias)`, g and beta are the raw a and b (`gdn_gates`' inputs), gated in the kernel."""
    out = prepare_gdn_out(q, k, v, g, beta, states, cu_seqlens, slot_ids, out)
    n_seq, dk, hv, dv = slot_ids.shape[0], q.shape[2], v.shape[1], v.shape[2]
    if n_seq == 0 or q.shape[0] == 0:
        return out
    bk, bv = next_pow2(dk), state_block_v(dk, dv)
    _gdn_recurrent_kernel[(n_seq, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, states, out, cu_seqlens, slot_ids,
        *(gates if gates is not None else (g, g)),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2),
        dk, dv, hv // q.shape[1], float(dk) ** -0.5, max_len,
        BK=bk, BV=bv, GATES=gates is not None, num_warps=4, **pdl_launch(q.device),
    )
    return out
