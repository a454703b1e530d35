"""Causal depthwise conv1d + SiLU over a ragged batch, with per-sequence conv state slots (prefill and decode).

Grid `(token block of the batch, channel block)`. A sequence's `K - 1` inputs before its first new row are its
slot's state, so rows whose window reaches back past the first new token read the state instead of `x`. Only
token block 0 has such rows (the block holds at least `K - 1` rows), so the same program also writes the new
state (the last `K - 1` inputs of state and new rows together): every read of the old state happens in that one
program, before a barrier, and the in-place update cannot race. A 1-token step is the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2, pdl_launch
from infer_backend_cuda.kernels._ragged import STEP_SIZE_ARGS, batch_block, ragged_block_b


@triton.jit(do_not_specialize=STEP_SIZE_ARGS)
def _causal_conv1d_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr,
    x_st, w_sc, s_ss, s_sc, o_st,
    C, n_seq,
    K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BLOCK_B: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    cb = tl.program_id(1)
    seq, tb = batch_block(cu_ptr, n_seq, pid, BT, BLOCK_B, 1)
    if seq < n_seq:  # else past the batch's last block (the grid is an upper bound)
        bos = tl.load(cu_ptr + seq).to(tl.int64)
        n = tl.load(cu_ptr + seq + 1).to(tl.int64) - bos
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        rows = tb * BT + tl.arange(0, BT)
        cols = cb * BC + tl.arange(0, BC)
        cm = cols < C
        valid = (rows < n)[:, None] & cm[None, :]
        s_base = state_ptr + slot * s_ss + cols[None, :] * s_sc
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(K):
            pos = rows - (K - 1) + j  # the input this tap reads, relative to the first new row
            from_x = (pos >= 0)[:, None]
            xv = tl.load(x_ptr + (bos + pos)[:, None] * x_st + cols[None, :], mask=valid & from_x, other=0.0)
            sv = tl.load(s_base + (pos + K - 1)[:, None], mask=valid & (~from_x), other=0.0)
            w = tl.load(w_ptr + cols * w_sc + j, mask=cm, other=0.0).to(tl.float32)
            acc += tl.where(from_x, xv.to(tl.float32), sv.to(tl.float32)) * w[None, :]
        y = acc / (1.0 + tl.exp(-acc))
        if tb == 0:
            # new state column i holds input (n - (K - 1) + i): a new row, or for short steps an old state column.
            i = tl.arange(0, KP)
            im = (i < K - 1)[:, None] & cm[None, :]
            src = n - (K - 1) + i
            src_x = (src >= 0)[:, None]
            nx = tl.load(x_ptr + (bos + src)[:, None] * x_st + cols[None, :], mask=im & src_x, other=0.0)
            ns = tl.load(s_base + (src + K - 1)[:, None], mask=im & (~src_x), other=0.0)
            new_state = tl.where(src_x, nx.to(state_ptr.dtype.element_ty), ns)
            tl.debug_barrier()  # every thread has read the old state before any overwrites it
            tl.store(s_base + i[:, None], new_state, mask=im)
        tl.store(out_ptr + (bos + rows)[:, None] * o_st + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=valid)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor, max_query_len: int, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x `[T, C]` with weight `[C, K]`, each sequence continuing from
    `conv_states[slot_ids[i]]` (`[C, K - 1]`, oldest first), which is then replaced by its last `K - 1` inputs."""
    t, c = x.shape
    k = weight.shape[1]
    if weight.shape[0] != c or tuple(conv_states.shape[1:]) != (c, k - 1):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, states {tuple(conv_states.shape)}")
    if k < 2:
        raise ValueError(f"a conv kernel of {k} keeps no state")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or conv_states.stride(-1) != 1:
        raise ValueError("x, weight and conv_states need a contiguous last dimension")
    if cu_seqlens.shape[0] != slot_ids.shape[0] + 1:
        raise ValueError("cu_seqlens must hold one more entry than slot_ids")
    if out is None:
        out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    n_seq = slot_ids.shape[0]
    if n_seq == 0:
        return out
    kp = next_pow2(k - 1)
    # Two token tiles (decode-sized, prefill-sized) rather than one per power of two of the longest query: each
    # is a compiled variant, and eager mixed steps would meet them while serving.
    bt = kp if max_query_len <= kp else max(kp, 64)
    bc = min(next_pow2(c), max(64, 2048 // bt))
    # Every sequence's token blocks but its last are full: at most cdiv(T, BT) + B of them, so the grid is
    # bounded by the step's tokens, not by B x max_query_len (a mixed step of many decode rows).
    grid = (triton.cdiv(t, bt) + n_seq, triton.cdiv(c, bc))
    _causal_conv1d_kernel[grid](
        x, weight, conv_states, out, cu_seqlens, slot_ids,
        x.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1), out.stride(0),
        c, n_seq, K=k, KP=kp, BT=bt, BC=bc, BLOCK_B=ragged_block_b(n_seq), num_warps=4, **pdl_launch(x.device),
    )
    return out
