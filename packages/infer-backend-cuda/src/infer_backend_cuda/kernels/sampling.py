"""Triton kernels of the sampler: the top-k / top-p cut over sorted logits, and the merge of the Numba draw
kernel's per-chunk partials into (token, logprob). One program per row each.

`topk_topp_threshold`: given the row's logits sorted descending (`sorted_vals[:, 0]` is the row max), the
temperature, top-k and top-p, returns the raw-logit threshold of the kept set: with `e_j = exp((s_j - s_0)/T)`
over the top-k prefix, keep sorted position j while the mass strictly before it is `< top_p * sum(e)`; the
threshold is the value at the last kept position (at least position 0). Two launches: per-(row, 1024-chunk)
masses in parallel, then per row a scan over the chunk masses to find the chunk holding the cut and a scan
inside that one chunk. Replaces ~10 full-width torch passes (exp, mask, cumsum, compares, reductions) with
one parallel read of the top-k prefix.

`merge_partials`: per row, the first chunk holding the maximal draw value (so the lowest token index on
ties, as torch.argmax), the combined log-sum-exp of the chunks' (max, sum-exp) pairs, and
`logprob = logits[token] - lse`; one launch instead of a dozen small torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import next_pow2


@triton.jit
def _chunk_mass_kernel(sv_ptr, temp_ptr, topk_ptr, mass_ptr, sv_stride, V, NCH, BLOCK: tl.constexpr):
    """Grid (N, NCH): mass_ptr[r, c] = sum over sorted positions j in chunk c, j < k of exp((s_j - s_0) / T)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    row = sv_ptr + r * sv_stride
    s0 = tl.load(row).to(tl.float32)
    t = tl.load(temp_ptr + r).to(tl.float32)
    t = tl.where(t == 0.0, 1.0, t)
    k = tl.load(topk_ptr + r).to(tl.int32)
    k = tl.where((k <= 0) | (k > V), V, k)
    j = c * BLOCK + tl.arange(0, BLOCK)
    m = j < k
    x = tl.load(row + j, mask=m, other=0.0).to(tl.float32)
    tl.store(mass_ptr + r * NCH + c, tl.sum(tl.where(m, tl.exp((x - s0) / t), 0.0), axis=0))


@triton.jit
def _threshold_kernel(
    sv_ptr, temp_ptr, topk_ptr, topp_ptr, mass_ptr, thr_ptr, max_ptr, sv_stride, V, NCH,
    BLOCK: tl.constexpr, NCH_PAD: tl.constexpr,
):
    """Per row: the chunk where the top-p cut falls (from the chunk masses), then the count inside it."""
    r = tl.program_id(0).to(tl.int64)
    row = sv_ptr + r * sv_stride
    s0 = tl.load(row).to(tl.float32)
    t = tl.load(temp_ptr + r).to(tl.float32)
    t = tl.where(t == 0.0, 1.0, t)
    k = tl.load(topk_ptr + r).to(tl.int32)
    k = tl.where((k <= 0) | (k > V), V, k)
    p = tl.load(topp_ptr + r).to(tl.float32)
    n_keep = k
    if p < 1.0:
        offs_c = tl.arange(0, NCH_PAD)
        cm = tl.load(mass_ptr + r * NCH + offs_c, mask=offs_c < NCH, other=0.0)
        limit = p * tl.sum(cm, axis=0)
        before_chunk = tl.cumsum(cm, axis=0) - cm
        # the last chunk whose first position is still kept (its mass-before < limit); chunk 0 always is
        # unless limit <= 0 (top_p <= 0 -> the top token alone)
        c_star = tl.maximum(tl.sum(((before_chunk < limit) & (offs_c < NCH)).to(tl.int32), axis=0) - 1, 0)
        base = tl.sum(tl.where(offs_c == c_star, before_chunk, 0.0), axis=0)
        j = c_star * BLOCK + tl.arange(0, BLOCK)
        m = j < k
        x = tl.load(row + j, mask=m, other=0.0).to(tl.float32)
        e = tl.where(m, tl.exp((x - s0) / t), 0.0)
        before = tl.cumsum(e, axis=0) - e + base
        n = c_star * BLOCK + tl.sum(((before < limit) & m).to(tl.int32), axis=0)
        n_keep = tl.minimum(tl.maximum(n, 1), k)
    thr = tl.load(row + (n_keep - 1)).to(tl.float32)
    tl.store(thr_ptr + r, thr)
    tl.store(max_ptr + r, s0)


def topk_topp_threshold(
    sorted_vals: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_vals `[N, V]` (descending, contiguous last dim) -> (threshold `[N]` f32, row max `[N]` f32)."""
    n_rows, vocab = sorted_vals.shape
    dev = sorted_vals.device
    thr = torch.empty((n_rows,), dtype=torch.float32, device=dev)
    row_max = torch.empty_like(thr)
    if n_rows == 0:
        return thr, row_max
    if sorted_vals.stride(-1) != 1:
        sorted_vals = sorted_vals.contiguous()
    block = min(1024, max(16, next_pow2(vocab)))
    nch = triton.cdiv(vocab, block)
    temperature, top_k, top_p = temperature.contiguous(), top_k.contiguous(), top_p.contiguous()
    mass = torch.empty((n_rows, nch), dtype=torch.float32, device=dev)
    _chunk_mass_kernel[(n_rows, nch)](
        sorted_vals, temperature, top_k, mass, sorted_vals.stride(0), vocab, nch, BLOCK=block, num_warps=4
    )
    _threshold_kernel[(n_rows,)](
        sorted_vals, temperature, top_k, top_p, mass, thr, row_max, sorted_vals.stride(0), vocab, nch,
        BLOCK=block, NCH_PAD=max(2, next_pow2(nch)), num_warps=4,
    )
    return thr, row_max


@triton.jit
def _merge_kernel(
    logits_ptr,
    val_ptr,
    idx_ptr,
    m_ptr,
    s_ptr,
    tok_ptr,
    lp_ptr,
    logits_stride,
    C,
    V,
    CPAD: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CPAD)
    mask = offs < C
    val = tl.load(val_ptr + r * C + offs, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + r * C + offs, mask=mask, other=V)
    best = tl.max(val, axis=0)
    tok = tl.min(tl.where((val == best) & mask, idx, V), axis=0)
    tok = tl.where(tok >= V, 0, tok)
    pm = tl.load(m_ptr + r * C + offs, mask=mask, other=float("-inf"))
    ps = tl.load(s_ptr + r * C + offs, mask=mask, other=0.0)
    mx = tl.max(pm, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    lse = mx + tl.log(tl.sum(tl.where(mask, ps * tl.exp(pm - mx), 0.0), axis=0))
    x = tl.load(logits_ptr + r * logits_stride + tok).to(tl.float32)
    tl.store(tok_ptr + r, tok.to(tl.int64))
    tl.store(lp_ptr + r, x - lse)


def merge_partials(
    logits: torch.Tensor, part_val: torch.Tensor, part_idx: torch.Tensor, part_m: torch.Tensor, part_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids int64 `[N]`, logprobs float32 `[N]`) from `[N, C]` partials (contiguous)."""
    n_rows, vocab = logits.shape
    chunks = part_val.shape[1]
    tok = torch.empty((n_rows,), dtype=torch.int64, device=logits.device)
    lp = torch.empty((n_rows,), dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return tok, lp
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _merge_kernel[(n_rows,)](
        logits, part_val, part_idx, part_m, part_s, tok, lp, logits.stride(0), chunks, vocab, CPAD=max(2, next_pow2(chunks)), num_warps=1
    )
    return tok, lp
