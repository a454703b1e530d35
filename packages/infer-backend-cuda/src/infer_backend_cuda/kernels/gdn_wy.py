"""Chunk-local pass of the chunked gated delta rule (`gdn_chunk`): everything of a 64-token chunk that does not
depend on the carried state, one program per (chunk of the batch, value head), all in parallel.

With `G` the in-chunk cumulative log decay, `kb = beta * k` and `M = strict_lower(kb k^T * exp(G_i - G_j))`, a
program computes `T = (I + M)^-1` and writes into one fp32 scratch row per token and value head

    w = T (kb * exp(G))    q * exp(G)    k * exp(G_last - G)    u = T (beta * v)    A = lower(q k^T * exp(G_i - G_j))

(q, k L2-normalised and q scaled first), so the sequential pass only multiplies these by the state.

`T` is a blocked inverse over 16-row blocks: the four diagonal blocks by forward substitution (16 row steps, the
four blocks in the same steps), then the off-diagonal blocks `T_ij = -T_ii sum_k M_ik T_kj` with dots. That is
forward substitution at block granularity, as stable as the row-by-row one (the Neumann product
`(I - M)(I + M^2)...` is not: powers of M grow combinatorially for similar keys, and cancel only in exact
arithmetic). Dots are tf32x3 (each fp32 operand split into a TF32 high part and a TF32 remainder, three
tensor-core products: ~fp32 accuracy); the interpreter computes them in plain fp32.
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
def _rows(ptr, rows, tm, row_st, col0, cols, cmask):
    """The fp32 `[rows, cols]` tile at `ptr + row * row_st + col0 + col`, zeros outside the masks."""
    return tl.load(ptr + rows[:, None] * row_st + col0 + cols[None, :], mask=tm[:, None] & cmask[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _put(ptr, rows, tm, row_st, col0, cols, cmask, x):
    tl.store(ptr + rows[:, None] * row_st + col0 + cols[None, :], x, mask=tm[:, None] & cmask[None, :])


@triton.jit
def _l2_rows(x):
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _decayed(a, b, ga, gb, DIAG: tl.constexpr, STRICT: tl.constexpr):
    """`(a b^T) * exp(ga_i - gb_j)` for a block of rows of `a` after those of `b` (ga <= gb, so the exponent is
    <= 0); on a diagonal block (DIAG) only `j < i` (STRICT) or `j <= i` is kept, the exponent masked first so
    the dropped entries cannot overflow."""
    p = _mm(a, tl.trans(b))
    if DIAG:
        i = tl.arange(0, a.shape[0])
        keep = (i[:, None] > i[None, :]) if STRICT else (i[:, None] >= i[None, :])
        return tl.where(keep, p * tl.exp(tl.where(keep, ga[:, None] - gb[None, :], 0.0)), 0.0)
    return p * tl.exp(ga[:, None] - gb[None, :])


@triton.jit
def _subst_row(m, t, i, r):
    """`t` with its row `i` set to row `i` of `(I + m)^-1` (m strictly lower; rows `< i` of `t` already done)."""
    sel = r[:, None] == i
    m_i = tl.sum(tl.where(sel, m, 0.0), axis=0)
    t_i = tl.where(r == i, 1.0, 0.0) - tl.sum(m_i[:, None] * t, axis=0)
    return tl.where(sel, t_i[None, :], t)


@triton.jit
def _sub_block(k_ptr, g_ptr, beta_ptr, k_st, k_off, g_st, beta_st, h, bos, n, r0, kk, km, SUB: tl.constexpr):
    """Token rows `r0 .. r0 + SUB` of the sequence: their rows, mask, L2-normalised keys, decays, betas."""
    i = tl.arange(0, SUB)
    rows = bos + r0 + i
    tm = (r0 + i) < n
    k = _l2_rows(_rows(k_ptr, rows, tm, k_st, k_off, kk, km))
    g = tl.load(g_ptr + rows * g_st + h, mask=tm, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * beta_st + h, mask=tm, other=0.0).to(tl.float32)
    return rows, tm, k, g, beta


@triton.jit
def _q_block(q_ptr, q_st, q_off, rows, tm, kk, km, scale, g, ks0, ks1, ks2, ks3, g0, g1, g2, g3,
             scr_ptr, scr_st, scr_off, QG, A, DIAG_IDX: tl.constexpr, SUB: tl.constexpr, kw):
    """For one block of rows: `q * exp(G)` and the row block of `A` (blocks up to the diagonal; those above are
    never read) into the scratch."""
    q = _l2_rows(_rows(q_ptr, rows, tm, q_st, q_off, kk, km)) * scale
    _put(scr_ptr, rows, tm, scr_st, scr_off + QG, kk, kw, q * tl.exp(g)[:, None])
    c = tl.arange(0, SUB)
    cm = c < SUB
    zero = tl.zeros((SUB, SUB), dtype=tl.float32)
    _put(scr_ptr, rows, tm, scr_st, scr_off + A, c, cm, _decayed(q, ks0, g, g0, DIAG_IDX == 0, False))
    if DIAG_IDX < 1:
        _put(scr_ptr, rows, tm, scr_st, scr_off + A + SUB, c, cm, zero)
    if DIAG_IDX < 2:
        _put(scr_ptr, rows, tm, scr_st, scr_off + A + 2 * SUB, c, cm, zero)
    if DIAG_IDX < 3:
        _put(scr_ptr, rows, tm, scr_st, scr_off + A + 3 * SUB, c, cm, zero)
    if DIAG_IDX >= 1:
        _put(scr_ptr, rows, tm, scr_st, scr_off + A + SUB, c, cm, _decayed(q, ks1, g, g1, DIAG_IDX == 1, False))
    if DIAG_IDX >= 2:
        _put(scr_ptr, rows, tm, scr_st, scr_off + A + 2 * SUB, c, cm, _decayed(q, ks2, g, g2, DIAG_IDX == 2, False))
    if DIAG_IDX >= 3:
        _put(scr_ptr, rows, tm, scr_st, scr_off + A + 3 * SUB, c, cm, _decayed(q, ks3, g, g3, True, False))


@triton.jit
def _wy_chunk(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, scr_ptr,
    q_st, q_off, k_st, k_off, v_st, v_off, g_st, beta_st, scr_st, scr_off,
    bos, n, c0, h, DK, DV, scale,
    SUB: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr,
):
    """One chunk (tokens `c0 .. c0 + 4 SUB` of the sequence at `bos`, `n` tokens) of value head `h`."""
    W, QG, KD, U, A = scratch_columns(BK, BDV)
    kk = tl.arange(0, BK)
    km = kk < DK
    dd = tl.arange(0, BDV)
    dm = dd < DV
    kw = kk < BK  # stores: whole padded sections (the loads' masks zero the columns past the head dims)
    dw = dd < BDV
    r0, tm0, k0, g0, b0 = _sub_block(k_ptr, g_ptr, beta_ptr, k_st, k_off, g_st, beta_st, h, bos, n,
                                         c0, kk, km, SUB)
    r1, tm1, k1, g1, b1 = _sub_block(k_ptr, g_ptr, beta_ptr, k_st, k_off, g_st, beta_st, h, bos, n,
                                         c0 + SUB, kk, km, SUB)
    r2, tm2, k2, g2, b2 = _sub_block(k_ptr, g_ptr, beta_ptr, k_st, k_off, g_st, beta_st, h, bos, n,
                                         c0 + 2 * SUB, kk, km, SUB)
    r3, tm3, k3, g3, b3 = _sub_block(k_ptr, g_ptr, beta_ptr, k_st, k_off, g_st, beta_st, h, bos, n,
                                         c0 + 3 * SUB, kk, km, SUB)
    # In-chunk cumulative log decay (rows past the sequence's end have g = 0: G stays, k = v = beta = 0).
    e0 = tl.sum(g0, axis=0)
    e1 = e0 + tl.sum(g1, axis=0)
    e2 = e1 + tl.sum(g2, axis=0)
    g_last = e2 + tl.sum(g3, axis=0)
    g0 = tl.cumsum(g0, axis=0)
    g1 = tl.cumsum(g1, axis=0) + e0
    g2 = tl.cumsum(g2, axis=0) + e1
    g3 = tl.cumsum(g3, axis=0) + e2

    # The state-free parts of the output and of the state update.
    _q_block(q_ptr, q_st, q_off, r0, tm0, kk, km, scale, g0, k0, k1, k2, k3, g0, g1, g2, g3,
             scr_ptr, scr_st, scr_off, QG, A, 0, SUB, kw)
    _q_block(q_ptr, q_st, q_off, r1, tm1, kk, km, scale, g1, k0, k1, k2, k3, g0, g1, g2, g3,
             scr_ptr, scr_st, scr_off, QG, A, 1, SUB, kw)
    _q_block(q_ptr, q_st, q_off, r2, tm2, kk, km, scale, g2, k0, k1, k2, k3, g0, g1, g2, g3,
             scr_ptr, scr_st, scr_off, QG, A, 2, SUB, kw)
    _q_block(q_ptr, q_st, q_off, r3, tm3, kk, km, scale, g3, k0, k1, k2, k3, g0, g1, g2, g3,
             scr_ptr, scr_st, scr_off, QG, A, 3, SUB, kw)
    _put(scr_ptr, r0, tm0, scr_st, scr_off + KD, kk, kw, k0 * tl.exp(g_last - g0)[:, None])
    _put(scr_ptr, r1, tm1, scr_st, scr_off + KD, kk, kw, k1 * tl.exp(g_last - g1)[:, None])
    _put(scr_ptr, r2, tm2, scr_st, scr_off + KD, kk, kw, k2 * tl.exp(g_last - g2)[:, None])
    _put(scr_ptr, r3, tm3, scr_st, scr_off + KD, kk, kw, k3 * tl.exp(g_last - g3)[:, None])

    # M's blocks, then T = (I + M)^-1 blockwise: the diagonal blocks by substitution, 16 steps for all four.
    kb0 = k0 * b0[:, None]
    kb1 = k1 * b1[:, None]
    kb2 = k2 * b2[:, None]
    kb3 = k3 * b3[:, None]
    m00 = _decayed(kb0, k0, g0, g0, True, True)
    m11 = _decayed(kb1, k1, g1, g1, True, True)
    m22 = _decayed(kb2, k2, g2, g2, True, True)
    m33 = _decayed(kb3, k3, g3, g3, True, True)
    r = tl.arange(0, SUB)
    t00 = tl.zeros((SUB, SUB), dtype=tl.float32)
    t11 = tl.zeros((SUB, SUB), dtype=tl.float32)
    t22 = tl.zeros((SUB, SUB), dtype=tl.float32)
    t33 = tl.zeros((SUB, SUB), dtype=tl.float32)
    for i in range(SUB):
        t00 = _subst_row(m00, t00, i, r)
        t11 = _subst_row(m11, t11, i, r)
        t22 = _subst_row(m22, t22, i, r)
        t33 = _subst_row(m33, t33, i, r)
    m10 = _decayed(kb1, k0, g1, g0, False, False)
    m20 = _decayed(kb2, k0, g2, g0, False, False)
    m21 = _decayed(kb2, k1, g2, g1, False, False)
    m30 = _decayed(kb3, k0, g3, g0, False, False)
    m31 = _decayed(kb3, k1, g3, g1, False, False)
    m32 = _decayed(kb3, k2, g3, g2, False, False)
    t10 = -_mm(t11, _mm(m10, t00))
    t21 = -_mm(t22, _mm(m21, t11))
    t20 = -_mm(t22, _mm(m20, t00) + _mm(m21, t10))
    t32 = -_mm(t33, _mm(m32, t22))
    t31 = -_mm(t33, _mm(m31, t11) + _mm(m32, t21))
    t30 = -_mm(t33, _mm(m30, t00) + _mm(m31, t10) + _mm(m32, t20))

    # w = T (kb * exp(G)), u = T (beta * v), row block by row block (the values loaded only now: registers).
    x0 = kb0 * tl.exp(g0)[:, None]
    x1 = kb1 * tl.exp(g1)[:, None]
    x2 = kb2 * tl.exp(g2)[:, None]
    x3 = kb3 * tl.exp(g3)[:, None]
    _put(scr_ptr, r0, tm0, scr_st, scr_off + W, kk, kw, _mm(t00, x0))
    _put(scr_ptr, r1, tm1, scr_st, scr_off + W, kk, kw, _mm(t10, x0) + _mm(t11, x1))
    _put(scr_ptr, r2, tm2, scr_st, scr_off + W, kk, kw, _mm(t20, x0) + _mm(t21, x1) + _mm(t22, x2))
    _put(scr_ptr, r3, tm3, scr_st, scr_off + W, kk, kw,
         _mm(t30, x0) + _mm(t31, x1) + _mm(t32, x2) + _mm(t33, x3))
    y0 = _rows(v_ptr, r0, tm0, v_st, v_off, dd, dm) * b0[:, None]
    y1 = _rows(v_ptr, r1, tm1, v_st, v_off, dd, dm) * b1[:, None]
    y2 = _rows(v_ptr, r2, tm2, v_st, v_off, dd, dm) * b2[:, None]
    y3 = _rows(v_ptr, r3, tm3, v_st, v_off, dd, dm) * b3[:, None]
    _put(scr_ptr, r0, tm0, scr_st, scr_off + U, dd, dw, _mm(t00, y0))
    _put(scr_ptr, r1, tm1, scr_st, scr_off + U, dd, dw, _mm(t10, y0) + _mm(t11, y1))
    _put(scr_ptr, r2, tm2, scr_st, scr_off + U, dd, dw, _mm(t20, y0) + _mm(t21, y1) + _mm(t22, y2))
    _put(scr_ptr, r3, tm3, scr_st, scr_off + U, dd, dw,
         _mm(t30, y0) + _mm(t31, y1) + _mm(t32, y2) + _mm(t33, y3))


@triton.jit(do_not_specialize=STEP_SIZE_ARGS + ("min_len",))
def _gdn_chunk_wy_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, scr_ptr, cu_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, g_st, beta_st, scr_st, scr_sh,
    DK, DV, GROUP, scale, n_seq, min_len,
    CH: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid `(cdiv(T, CH) + n_seq, Hv)` over the batch's chunks (an upper bound: programs past the last chunk,
    and those of sequences shorter than `min_len`, which another kernel runs, exit at once)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    h = tl.program_id(1)
    seq, chunk = batch_block(cu_ptr, n_seq, tl.program_id(0), CH, BLOCK_B, 1)
    if seq < n_seq:
        bos = tl.load(cu_ptr + seq).to(tl.int64)
        n = tl.load(cu_ptr + seq + 1).to(tl.int64) - bos
        if n >= min_len:
            hk = h // GROUP
            _wy_chunk(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, scr_ptr,
                q_st, hk * q_sh, k_st, hk * k_sh, v_st, h * v_sh, g_st, beta_st, scr_st, h * scr_sh,
                bos, n, chunk * CH, h, DK, DV, scale, CH // 4, BK, BDV,
            )
