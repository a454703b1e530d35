"""Plain-torch references for the CUDA adapter's kernels (fp32 math, independent of the kernels' code),
and builders of random paged-attention batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

M32 = 0xFFFFFFFF


def rand_offset(shape, dtype, device, seed: int) -> torch.Tensor:
    """Seeded normal values shifted by 0.25 (GEMM sums that do not cancel towards zero), in `dtype` on `device`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) + 0.25).to(dtype=dtype, device=device)


def ref_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T (+ b)` in fp32."""
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def ref_add_rms_norm(x, residual, w, eps):
    s = (x.float() + residual.float()).to(residual.dtype)
    return ref_rms_norm(s, w, eps), s


def ref_silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    i = gu.shape[-1] // 2
    g, u = gu[..., :i].float(), gu[..., i:].float()
    return (torch.nn.functional.silu(g) * u).to(gu.dtype)


def make_cos_sin_cache(max_pos: int, head_dim: int, base: float = 10000.0, dtype=torch.float32, device="cpu"):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype=dtype, device=device)


def ref_qk_norm_rope(q, k, positions, cos_sin_cache, q_w, k_w, eps):
    """Returns rotated (q, k) in the inputs' dtype. Norm output is rounded to the activation dtype (as when
    the unfused norm materialises it), the rotation runs in fp32. A cache narrower than the head (partial
    rotary) rotates only the first `cos_sin_cache.shape[-1]` dims of each head; the rest pass through."""
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def one(x, w):
        if w is not None:
            xf = x.float()
            x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half:rot], xf[..., rot:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)

    return one(q, q_w), one(k, k_w)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    q_lens: list[int]
    ctx_lens: list[int]
    block_size: int

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens) if self.q_lens else 0


def make_paged_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    extra_blocks: int = 3,
) -> PagedBatch:
    """Random q and paged K/V for sequences with `q_lens[i]` new tokens and `ctx_lens[i]` context tokens.
    Pages are shuffled; every cache slot outside a sequence's context holds NaN (a kernel that reads it
    poisons its output); a `ctx_len` of 0 is a padding row with an all -1 block table."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(n_pages) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(max(n_pages, default=0), 1) + 1
    bt = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    nxt = 0
    for i, c in enumerate(ctx_lens):
        pages = perm[nxt : nxt + n_pages[i]]
        nxt += n_pages[i]
        bt[i, : n_pages[i]] = pages.to(torch.int32)
        for j in range(c):
            p, o = int(pages[j // block_size]), j % block_size
            k_cache[p, o] = torch.randn((num_kv_heads, head_dim), generator=g)
            v_cache[p, o] = torch.randn((num_kv_heads, head_dim), generator=g)
    t = sum(q_lens)
    q = torch.randn((t, num_q_heads, head_dim), generator=g)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    return PagedBatch(
        q=q.to(dtype=dtype, device=device),
        k_cache=k_cache.to(dtype=dtype, device=device),
        v_cache=v_cache.to(dtype=dtype, device=device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=bt.to(device),
        q_lens=list(q_lens),
        ctx_lens=list(ctx_lens),
        block_size=block_size,
    )


def ref_paged_attention(pb: PagedBatch, scale: float) -> torch.Tensor:
    """fp32 causal attention; rows of a sequence are the last q_len positions of its context. Rows with an
    empty context are zeros."""
    q = pb.q.float().cpu()
    kc, vc = pb.k_cache.float().cpu(), pb.v_cache.float().cpu()
    bt = pb.block_tables.cpu()
    hq, hkv = q.shape[1], kc.shape[2]
    out = torch.zeros_like(q)
    start = 0
    for i, (ql, ctx) in enumerate(zip(pb.q_lens, pb.ctx_lens)):
        if ql == 0:
            continue
        if ctx == 0:
            start += ql
            continue
        idx = torch.arange(ctx)
        pages = bt[i, idx // pb.block_size].long()
        k = kc[pages, idx % pb.block_size].repeat_interleave(hq // hkv, dim=1)  # [ctx, Hq, D]
        v = vc[pages, idx % pb.block_size].repeat_interleave(hq // hkv, dim=1)
        qi = q[start : start + ql]  # [ql, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        qpos = ctx - ql + torch.arange(ql)
        s = s.masked_fill(idx[None, None, :] > qpos[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", p, v)
        start += ql
    return out.to(pb.q.dtype)


# ---------------------------------------------------------------------------------------------------------
# The sampler scheme (written from the spec, row by row; shared with the CPU backend).


def mix32_t(x: torch.Tensor) -> torch.Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def ref_uniforms(seed: int, position: int, vocab: int) -> torch.Tensor:
    """u for every vocab index of one row, float64, from the counter-based hash (int64 tensors)."""
    h = mix32_t(torch.tensor((seed & M32) ^ int(mix32_t(torch.tensor(position & M32))), dtype=torch.int64))
    v = torch.arange(vocab, dtype=torch.int64)
    return (mix32_t((h + v) & M32).double() + 0.5) / 2.0**32


def ref_sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, position: int) -> int:
    logits = logits.float().cpu()
    vocab = logits.shape[0]
    if temperature == 0.0:
        return int(torch.argmax(logits))
    s = logits / torch.tensor(temperature, dtype=torch.float32)
    keep = torch.ones(vocab, dtype=torch.bool)
    vals = torch.sort(s, descending=True).values
    if 0 < top_k < vocab:
        keep &= s >= vals[top_k - 1]
    if top_p < 1.0:
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        ps = torch.sort(p, descending=True).values
        mass, n = 0.0, 0
        for val in ps.tolist():  # smallest prefix with mass >= top_p, top token always kept
            n += 1
            mass += val
            if mass >= top_p:
                break
        keep &= p >= ps[n - 1]
    probs = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    u = ref_uniforms(seed, position, vocab)
    return int(torch.argmax(probs.double() / -torch.log(u)))
