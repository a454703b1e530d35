"""Chunked gated delta rule (the WY form, chunks of 64 tokens) over a ragged batch with state slots (prefill).

Three launches. The chunk-local pass (`gdn_wy`: a Gram launch, then a solve launch, each one program per chunk
of the batch and value head, all in parallel) writes per token the fp32 scratch rows `w`, `u`, `q * exp(G)`,
`k * exp(G_last - G)` and the row of `A = lower(q k^T * exp(G_i - G_j))` (`G` the in-chunk cumulative log
decay); then the sequential pass (one program per sequence, value head and block of `BV` value columns) walks
the sequence's chunks, carrying its `[Dk, BV]` slice of the fp32 state in registers from the slot and back. Per
chunk that is four products with the state and nothing else:

    v' = u - w S
    o = (q * exp(G)) S + A v'
    S = exp(G_last) S + (k * exp(G_last - G))^T v'

which is transformers' `torch_chunk_gated_delta_rule` (q, k L2-normalised and q scaled inside). The sequential
pass's state products are tf32x3 `tl.dot`s (three TF32 tensor-core products of split fp32 operands, ~fp32
accuracy; plain TF32 would carry its 2^-11 relative error into the state, chunk after chunk), its output products
plain TF32 for a bf16 / fp16 output (`out_precision`), and the chunk-local pass's
are exact bf16 products or bf16x3 / tf32x3 splits (see `gdn_wy`), so the result equals the per-token
recurrence up to about fp32 rounding. Tokens past a sequence's end load as zeros, which leaves the state
unchanged.

A mixed step sends its short rows (decode) to `gdn_recurrent` instead: both launches take a length bound
(`min_len` here) and their programs for other sequences exit at once, so neither grid depends on the lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import interpreting, next_pow2, pdl_launch
from infer_backend_cuda.kernels._ragged import ragged_block_b
from infer_backend_cuda.kernels.gdn_recurrent import prepare_gdn_out, sequence_head_block
from infer_backend_cuda.kernels.gdn_wy import (
    CHUNK,
    PREC,
    _gdn_chunk_gram_kernel,
    _gdn_chunk_solve_kernel,
    scratch_columns,
    scratch_width,
)

# Value columns per program of the sequential pass: one Qwen3.5 prefill (32 value heads) has 128 programs for
# ~132 SMs, and the state tile (Dk x 32 fp32) takes 32 registers per thread at 4 warps.
BV = 32
# Compiled offline for sm_90 (bf16 output) this configuration spills ~2.1 KB per thread and runs ~3,900 SASS
# instructions per chunk step (4,600 and 2.4 KB with tf32x3 output products; mostly the splits of the 64-row
# scratch tiles): latency-bound, one program per SM. scripts/bench_gdn.py times BV 16 and 8 warps against it
# (module constants, so the benchmark can swap them).
STATE_WARPS = 4


@triton.jit(do_not_specialize=("min_len",))
def _gdn_chunk_state_kernel(
    g_ptr, scr_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr,
    g_st, scr_st, scr_sh, o_st, o_sh, s_ss, s_sh, s_sk,
    DK, DV, min_len,
    CH: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, BV: tl.constexpr, OUT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Sequential pass, grid `(B, Hv, cdiv(Dv, BV))`; programs of sequences shorter than `min_len` exit.
    `OUT_PREC`: of the two output products, which feed no state."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    _, h, bos, n, kk, vv, km, vm, s_ptrs, smask = sequence_head_block(
        cu_ptr, slot_ptr, state_ptr, s_ss, s_sh, s_sk, DK, DV, 1, BK, BV
    )
    if n >= min_len:
        W, QG, KD, U, A = scratch_columns(BK, BDV)
        ci = tl.arange(0, CH)
        state = tl.load(s_ptrs, mask=smask, other=0.0)
        for c0 in range(0, n, CH):
            # No masks on the scratch tiles (their predicates and addresses, hoisted out of the loop, spilled):
            # sections are written whole, and a partial chunk's rows past the end re-read its last row, whose
            # v' is zeroed, so they reach neither the state (k^T v') nor a valid row's output (A is zero there).
            tm = (c0 + ci) < n
            r = tl.minimum(ci, n - 1 - c0).to(tl.int32) * scr_st
            scr = scr_ptr + (bos + c0) * scr_st + h * scr_sh
            w = tl.load(scr + W + r[:, None] + kk[None, :])
            u = tl.load(scr + U + r[:, None] + vv[None, :])
            v_new = tl.where(tm[:, None], u - tl.dot(w, state, input_precision=PREC), 0.0)
            qg = tl.load(scr + QG + r[:, None] + kk[None, :])
            a = tl.load(scr + A + r[:, None] + ci[None, :])
            o = tl.dot(qg, state, input_precision=OUT_PREC)
            o = tl.dot(a, v_new, o, input_precision=OUT_PREC)
            tl.store(out_ptr + (bos + c0) * o_st + h * o_sh + ci[:, None] * o_st + vv[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=tm[:, None] & vm[None, :])
            kd = tl.load(scr + KD + r[:, None] + kk[None, :])
            g_last = tl.sum(tl.load(g_ptr + (bos + c0) * g_st + ci * g_st + h, mask=tm, other=0.0), axis=0)
            state = tl.dot(tl.trans(kd), v_new, state * tl.exp(g_last), input_precision=PREC)
        tl.store(s_ptrs, state, mask=smask)


def out_precision(dtype: torch.dtype) -> str:
    """`tl.dot` precision of the output products `(q exp(G)) S + A v'`: they feed no state, so an output rounded to
    bf16 / fp16 (2^-9 / 2^-12 relative) takes plain TF32 (2^-11 per operand, one tensor-core product instead of
    three); an fp32 output keeps tf32x3."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def gdn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor | None = None,
    min_len: int = 0,
) -> torch.Tensor:
    """The gated delta rule in chunks of 64 tokens (same operands and result as `gdn_recurrent`), for the
    sequences of at least `min_len` tokens; the others' output rows and state slots are left untouched."""
    out = prepare_gdn_out(q, k, v, g, beta, states, cu_seqlens, slot_ids, out)
    n_seq, dk, hv, dv = slot_ids.shape[0], q.shape[2], v.shape[1], v.shape[2]
    if n_seq == 0 or q.shape[0] == 0:
        return out
    bk = max(16, next_pow2(dk))  # tl.dot needs every dimension >= 16
    bdv = max(16, next_pow2(dv))
    bv = min(bdv, BV)
    # fp32 scratch of the chunk-local pass, one row per token and value head (74 KB per token at Qwen3.5-4B,
    # 605 MB for an 8k-token step), and its M / T buffer (a 64-column row each, 67 MB), freed after the call.
    scr = torch.empty((q.shape[0], hv, scratch_width(bk, bdv)), dtype=torch.float32, device=q.device)
    mt = torch.empty((q.shape[0], hv, CHUNK), dtype=torch.float32, device=q.device)
    pdl = pdl_launch(q.device)
    # Every sequence's chunks but its last are full, so the batch has at most cdiv(T, 64) + B of them: the grid
    # is bounded by the step's tokens, not by B x max_query_len (a mixed step of many decode rows).
    grid = (triton.cdiv(q.shape[0], CHUNK) + n_seq, hv)
    # bf16 dots on the raw rows only where those are bf16 (the models); fp32 / fp16 inputs take tf32x3.
    lowp = q.dtype == k.dtype == v.dtype == torch.bfloat16
    # Warps from offline sm_90 compiles at Qwen3.5-4B tiles with the launch's divisibility hints (Triton 3.6, as on
    # the device): gram 142 registers at 8 warps (255 at 4), solve 255 at 4; neither spills (docs/kernels.md).
    common = dict(CH=CHUNK, BK=bk, BDV=bdv, BLOCK_B=ragged_block_b(n_seq), LOWP=lowp, INTERP=interpreting(), **pdl)
    _gdn_chunk_gram_kernel[grid](
        q, k, g, beta, mt, scr, cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), beta.stride(0),
        mt.stride(0), mt.stride(1), scr.stride(0), scr.stride(1),
        dk, hv // q.shape[1], float(dk) ** -0.5, n_seq, min_len, num_warps=8, **common,
    )
    _gdn_chunk_solve_kernel[grid](
        k, v, g, beta, mt, scr, cu_seqlens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        mt.stride(0), mt.stride(1), scr.stride(0), scr.stride(1),
        dk, dv, hv // q.shape[1], n_seq, min_len, num_warps=4, **common,
    )
    _gdn_chunk_state_kernel[(n_seq, hv, triton.cdiv(dv, bv))](
        g, scr, states, out, cu_seqlens, slot_ids,
        g.stride(0), scr.stride(0), scr.stride(1), out.stride(0), out.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        dk, dv, min_len,
        CH=CHUNK, BK=bk, BDV=bdv, BV=bv, OUT_PREC=out_precision(out.dtype), num_warps=STATE_WARPS, num_stages=1,
        **pdl,
    )
    return out
