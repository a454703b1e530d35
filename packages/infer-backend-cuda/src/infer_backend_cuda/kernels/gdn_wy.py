"""Chunk-local pass of the chunked gated delta rule (`gdn_chunk`): everything of a 64-token chunk that does not
depend on the carried state, two launches of one program per (chunk of the batch, value head), all in parallel.

With `G` the in-chunk cumulative log decay, `rk`, `rq` the inverse L2 norms of the raw rows and
`M = strict_lower(beta_i rk_i rk_j (k k^T)_ij exp(G_i - G_j))`, the two launches write into one fp32 scratch row
per token and value head

    w = T diag(beta exp(G) rk) k    q rq scale exp(G)    k rk exp(G_last - G)    u = T diag(beta) v
    A = lower(rq_i scale rk_j (q k^T)_ij exp(G_i - G_j))

with `T = (I + M)^-1`, so the sequential pass only multiplies these by the state.

`_gdn_chunk_gram_kernel` does the two 64 x 64 Gram products on the raw q and k (the L2 norms, beta and the
decays are diagonal scalings, applied to the fp32 products after the dot), writes `A`, the scaled q and k, and
`M` into a separate fp32 buffer (zeros on and above the diagonal). `_gdn_chunk_solve_kernel` inverts `I + M`
blocked over 16-row blocks: the four diagonal blocks by forward substitution (16 row steps, the four blocks in
the same steps, each row of M loaded from the buffer), then the off-diagonal blocks `T_ij = -T_ii sum_k M_ik T_kj`
with tf32x3 dots. That is forward substitution at block granularity, as stable as the row-by-row one (the
Neumann product `(I - M)(I + M^2)...` is not: powers of M grow combinatorially for similar keys, and cancel only
in exact arithmetic). It writes T over M, reloads it as one 64 x 64 tile and forms w and u as two 64-row dots
with the raw k and v.

Precision. With bf16 inputs (the models) the dots whose operands are the raw bf16 rows are bf16 tensor-core dots
accumulating in fp32: a product of two bf16 numbers is exact in fp32, so these equal fp32 dots of the same values
up to the summation order. The fp32 left operand of w and u (T with its columns scaled) is split into three bf16
terms `hi + mid + lo` (24 significand bits, as fp32) and multiplied by k / v in three bf16 dots ("bf16x3"). With
fp32 inputs every dot is tf32x3 (each operand split into a TF32 high part and remainder, three TF32 products).
The small 16 x 16 products of the inverse are tf32x3 either way. Under the interpreter, which multiplies bf16
operands as their bit patterns, the bf16 terms are upcast first, so the splits (and their truncating rounding)
are still what the tests check.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infer_backend_cuda.kernels._ragged import STEP_SIZE_ARGS, batch_block

CHUNK = 64
# Near-fp32 products on the tensor cores: a.hi b.hi + a.hi b.lo + a.lo b.hi with TF32 halves.
PREC: tl.constexpr = tl.constexpr("tf32x3")


def scratch_width(bk: int, bdv: int) -> int:
    """fp32 columns of one scratch row (token, value head): w, q * exp(G), k * exp(G_last - G) (BK each), u (BDV),
    the whole row of A (CHUNK). Sections are padded to the power-of-two tiles and written whole (zeros past the
    head dims, above A's diagonal), so the sequential pass loads them without masks."""
    return 3 * bk + bdv + CHUNK


@triton.jit
def scratch_columns(BK: tl.constexpr, BDV: tl.constexpr):
    """First columns of w, q * exp(G), k * exp(G_last - G), u and A within a scratch row (see `scratch_width`)."""
    return 0, BK, 2 * BK, 3 * BK, 3 * BK + BDV


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _dot_raw(a, b, LOWP: tl.constexpr, INTERP: tl.constexpr):
    """`a @ b` (fp32) for operands in the input dtype: bf16 dots (exact products, fp32 sums) when LOWP, else
    tf32x3; under the interpreter bf16 operands are upcast (it would multiply their bit patterns)."""
    if LOWP and INTERP:
        p = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif LOWP:
        p = tl.dot(a, b)
    else:
        p = _mm(a, b)
    return p


@triton.jit
def _dot_split(x, b, LOWP: tl.constexpr, INTERP: tl.constexpr):
    """`x @ b` for an fp32 `x` and `b` in the input dtype: with bf16 `b`, `x` as the three bf16 terms of its
    significand (smallest first into the fp32 accumulator), else tf32x3."""
    if LOWP:
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        p = _dot_raw(lo, b, LOWP, INTERP)
        p += _dot_raw(mid, b, LOWP, INTERP)
        p += _dot_raw(hi, b, LOWP, INTERP)
    else:
        p = _mm(x, b)
    return p


@triton.jit
def _rows(ptr, rows, tm, row_st, col0, cols, cmask):
    """The `[rows, cols]` tile at `ptr + row * row_st + col0 + col` in its stored dtype, zeros outside the masks."""
    return tl.load(ptr + rows[:, None] * row_st + col0 + cols[None, :], mask=tm[:, None] & cmask[None, :],
                   other=0.0)


@triton.jit
def _put(ptr, rows, tm, row_st, col0, cols, cmask, x):
    tl.store(ptr + rows[:, None] * row_st + col0 + cols[None, :], x, mask=tm[:, None] & cmask[None, :])


@triton.jit
def _operand(x, LOWP: tl.constexpr):
    """A loaded q / k / v tile as a dot operand: as stored when LOWP (bf16), else fp32."""
    return x if LOWP else x.to(tl.float32)


@triton.jit
def _inv_norm(x):
    xf = x.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) + 1e-6)


@triton.jit
def _chunk_rows(cu_ptr, n_seq, min_len, CH: tl.constexpr, BLOCK_B: tl.constexpr):
    """This program's chunk: (whether it has one, its first token, its rows' token indices, how many of them
    are valid, their mask). Programs past the last chunk, and those of sequences shorter than `min_len` (which another kernel
    runs), have none."""
    seq, chunk = batch_block(cu_ptr, n_seq, tl.program_id(0), CH, BLOCK_B, 1)
    live = seq < n_seq
    bos = tl.load(cu_ptr + seq, mask=live, other=0).to(tl.int64)
    n = tl.load(cu_ptr + seq + 1, mask=live, other=0).to(tl.int64) - bos
    i = tl.arange(0, CH)
    nv = n - chunk * CH
    first = bos + chunk * CH
    return live & (n >= min_len) & (n > 0), first, first + i, nv, i < nv


@triton.jit
def _decays(g_ptr, g_st, rows, tm, h):
    """In-chunk cumulative log decay G and its last entry (rows past the sequence's end have g = 0)."""
    g = tl.load(g_ptr + rows * g_st + h, mask=tm, other=0.0).to(tl.float32)
    return tl.cumsum(g, axis=0), tl.sum(g, axis=0)


@triton.jit(do_not_specialize=STEP_SIZE_ARGS + ("min_len",))
def _gdn_chunk_gram_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, m_ptr, scr_ptr, cu_ptr,
    q_st, q_sh, k_st, k_sh, g_st, beta_st, m_st, m_sh, scr_st, scr_sh,
    DK, GROUP, scale, n_seq, min_len,
    CH: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, BLOCK_B: tl.constexpr, LOWP: tl.constexpr,
    INTERP: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid `(cdiv(T, CH) + n_seq, Hv)` over the batch's chunks (an upper bound, see `_chunk_rows`): `A`, the
    scaled q and k into the scratch, `M` into its buffer."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    h = tl.program_id(1)
    live, _, rows, nv, tm = _chunk_rows(cu_ptr, n_seq, min_len, CH, BLOCK_B)
    if live:
        W, QG, KD, U, A = scratch_columns(BK, BDV)
        i = tl.arange(0, CH)
        kk = tl.arange(0, BK)
        km = kk < DK
        kw = kk < BK  # stores: whole padded sections (the loads' masks zero the columns past the head dims)
        cw = i < CH
        hk = h // GROUP
        k = _rows(k_ptr, rows, tm, k_st, hk * k_sh, kk, km)
        q = _rows(q_ptr, rows, tm, q_st, hk * q_sh, kk, km)
        G, g_last = _decays(g_ptr, g_st, rows, tm, h)
        beta = tl.load(beta_ptr + rows * beta_st + h, mask=tm, other=0.0).to(tl.float32)
        rk = _inv_norm(k)
        rq = _inv_norm(q) * scale
        scr = scr_ptr + h * scr_sh
        _put(scr, rows, tm, scr_st, QG, kk, kw, q.to(tl.float32) * (rq * tl.exp(G))[:, None])
        _put(scr, rows, tm, scr_st, KD, kk, kw, k.to(tl.float32) * (rk * tl.exp(g_last - G))[:, None])
        kt = tl.trans(_operand(k, LOWP))
        # G is non-increasing, so exp(G_i - G_j) <= 1 where kept; the exponent is masked first so that the
        # dropped entries cannot overflow.
        lower = i[:, None] >= i[None, :]
        strict = i[:, None] > i[None, :]
        dg = G[:, None] - G[None, :]
        a = _dot_raw(_operand(q, LOWP), kt, LOWP, INTERP) * (rq[:, None] * rk[None, :])
        _put(scr, rows, tm, scr_st, A, i, cw, tl.where(lower, a * tl.exp(tl.where(lower, dg, 0.0)), 0.0))
        m = _dot_raw(_operand(k, LOWP), kt, LOWP, INTERP) * ((beta * rk)[:, None] * rk[None, :])
        _put(m_ptr + h * m_sh, rows, tm, m_st, 0, i, cw, tl.where(strict, m * tl.exp(tl.where(strict, dg, 0.0)), 0.0))


@triton.jit
def _m_block(mb, m_st, nv, R0: tl.constexpr, C0: tl.constexpr, SUB: tl.constexpr):
    """The `SUB x SUB` block of M at rows `R0`, columns `C0` of the chunk (rows past its `nv` valid ones zero)."""
    r = tl.arange(0, SUB)
    return tl.load(mb + (R0 + r)[:, None] * m_st + C0 + r[None, :], mask=((R0 + r) < nv)[:, None], other=0.0)


@triton.jit
def _subst_row(mb, m_st, nv, B0: tl.constexpr, j, t, r):
    """`t` with its row `j` set to row `j` of the diagonal block at `B0` of `(I + M)^-1` (rows `< j` of `t`
    already done, the others still identity rows; M is zero on and above its diagonal)."""
    m_j = tl.load(mb + (B0 + j) * m_st + B0 + r, mask=(B0 + j + r * 0) < nv, other=0.0)  # a vector mask
    t_j = tl.where(r == j, 1.0, 0.0) - tl.sum(m_j[:, None] * t, axis=0)
    return tl.where(r[:, None] == j, t_j[None, :], t)


@triton.jit
def _put_block(mb, m_st, nv, R0: tl.constexpr, C0: tl.constexpr, SUB: tl.constexpr, x):
    r = tl.arange(0, SUB)
    tl.store(mb + (R0 + r)[:, None] * m_st + C0 + r[None, :], x, mask=((R0 + r) < nv)[:, None])


@triton.jit
def _invert(mb, m_st, nv, SUB: tl.constexpr):
    """Overwrites the chunk's M (at `mb`, row stride `m_st`, `nv` valid rows) with `T = (I + M)^-1`, blockwise."""
    r = tl.arange(0, SUB)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    t00 = eye
    t11 = eye
    t22 = eye
    t33 = eye
    for j in range(1, SUB):
        t00 = _subst_row(mb, m_st, nv, 0, j, t00, r)
        t11 = _subst_row(mb, m_st, nv, SUB, j, t11, r)
        t22 = _subst_row(mb, m_st, nv, 2 * SUB, j, t22, r)
        t33 = _subst_row(mb, m_st, nv, 3 * SUB, j, t33, r)
    m10 = _m_block(mb, m_st, nv, SUB, 0, SUB)
    m20 = _m_block(mb, m_st, nv, 2 * SUB, 0, SUB)
    m21 = _m_block(mb, m_st, nv, 2 * SUB, SUB, SUB)
    m30 = _m_block(mb, m_st, nv, 3 * SUB, 0, SUB)
    m31 = _m_block(mb, m_st, nv, 3 * SUB, SUB, SUB)
    m32 = _m_block(mb, m_st, nv, 3 * SUB, 2 * SUB, SUB)
    t10 = -_mm(t11, _mm(m10, t00))
    t21 = -_mm(t22, _mm(m21, t11))
    t20 = -_mm(t22, _mm(m20, t00) + _mm(m21, t10))
    t32 = -_mm(t33, _mm(m32, t22))
    t31 = -_mm(t33, _mm(m31, t11) + _mm(m32, t21))
    t30 = -_mm(t33, _mm(m30, t00) + _mm(m31, t10) + _mm(m32, t20))
    tl.debug_barrier()  # every thread has read its M entries before T overwrites them
    _put_block(mb, m_st, nv, 0, 0, SUB, t00)
    _put_block(mb, m_st, nv, SUB, 0, SUB, t10)
    _put_block(mb, m_st, nv, SUB, SUB, SUB, t11)
    _put_block(mb, m_st, nv, 2 * SUB, 0, SUB, t20)
    _put_block(mb, m_st, nv, 2 * SUB, SUB, SUB, t21)
    _put_block(mb, m_st, nv, 2 * SUB, 2 * SUB, SUB, t22)
    _put_block(mb, m_st, nv, 3 * SUB, 0, SUB, t30)
    _put_block(mb, m_st, nv, 3 * SUB, SUB, SUB, t31)
    _put_block(mb, m_st, nv, 3 * SUB, 2 * SUB, SUB, t32)
    _put_block(mb, m_st, nv, 3 * SUB, 3 * SUB, SUB, t33)
    tl.debug_barrier()  # T complete (above the diagonal blocks the buffer keeps M's zeros) before it is reloaded


@triton.jit(do_not_specialize=STEP_SIZE_ARGS + ("min_len",))
def _gdn_chunk_solve_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, m_ptr, scr_ptr, cu_ptr,
    k_st, k_sh, v_st, v_sh, g_st, beta_st, m_st, m_sh, scr_st, scr_sh,
    DK, DV, GROUP, n_seq, min_len,
    CH: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, BLOCK_B: tl.constexpr, LOWP: tl.constexpr,
    INTERP: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Same grid as `_gdn_chunk_gram_kernel`: T over M, then w and u into the scratch."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    h = tl.program_id(1)
    live, first, rows, nv, tm = _chunk_rows(cu_ptr, n_seq, min_len, CH, BLOCK_B)
    if live:
        mb = m_ptr + h * m_sh + first * m_st
        _invert(mb, m_st, nv, CH // 4)
        i = tl.arange(0, CH)
        t = tl.load(mb + i[:, None] * m_st + i[None, :], mask=tm[:, None], other=0.0)
        kk = tl.arange(0, BK)
        dd = tl.arange(0, BDV)
        k = _rows(k_ptr, rows, tm, k_st, (h // GROUP) * k_sh, kk, kk < DK)
        G, _ = _decays(g_ptr, g_st, rows, tm, h)
        beta = tl.load(beta_ptr + rows * beta_st + h, mask=tm, other=0.0).to(tl.float32)
        scr = scr_ptr + h * scr_sh
        W, QG, KD, U, A = scratch_columns(BK, BDV)
        tw = t * (beta * tl.exp(G) * _inv_norm(k))[None, :]
        _put(scr, rows, tm, scr_st, W, kk, kk < BK, _dot_split(tw, _operand(k, LOWP), LOWP, INTERP))
        v = _rows(v_ptr, rows, tm, v_st, h * v_sh, dd, dd < DV)
        _put(scr, rows, tm, scr_st, U, dd, dd < BDV, _dot_split(t * beta[None, :], _operand(v, LOWP), LOWP, INTERP))
