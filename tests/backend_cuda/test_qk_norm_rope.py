"""QK-norm + NeoX RoPE fused with the paged KV store, against plain torch."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels._common import interpreting
from tests.backend_cuda.conftest import gpu, poison, tol
from tests.backend_cuda.reference import make_cos_sin_cache, ref_qk_norm_rope

# (tokens, Hq, Hkv, head_dim, block_size, num_blocks[, rotary_dim]); rotary_dim < head_dim is partial rotary
SMALL = [(5, 2, 2, 16, 4, 4), (7, 4, 2, 32, 8, 3), (6, 4, 1, 32, 16, 2), (5, 4, 1, 64, 4, 3, 16), (4, 2, 1, 48, 4, 2, 8)]
LARGE = [(300, 32, 8, 128, 16, 40), (64, 16, 8, 128, 16, 8), (33, 8, 2, 64, 32, 4), (17, 16, 16, 256, 16, 3)]


def _case(n_tok, hq, hkv, d, bs, nb, dtype, device, with_norm, fused_qkv, seed=0, rotary_dim=None):
    g = torch.Generator().manual_seed(seed)
    if fused_qkv:  # q, k, v as strided views of one [T, (Hq + 2 Hkv) * D] projection output
        qkv = torch.randn((n_tok, (hq + 2 * hkv) * d), generator=g).to(dtype=dtype, device=device)
        q = qkv[:, : hq * d].view(n_tok, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(n_tok, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(n_tok, hkv, d)
    else:
        q = torch.randn((n_tok, hq, d), generator=g).to(dtype=dtype, device=device)
        k = torch.randn((n_tok, hkv, d), generator=g).to(dtype=dtype, device=device)
        v = torch.randn((n_tok, hkv, d), generator=g).to(dtype=dtype, device=device)
    max_pos = 4096
    positions = torch.randint(0, max_pos, (n_tok,), generator=g).to(device)
    cs = make_cos_sin_cache(max_pos, rotary_dim or d, dtype=torch.float32, device=device)
    qw = kw = None
    if with_norm:
        qw = (torch.rand((d,), generator=g) + 0.5).to(dtype=dtype, device=device)
        kw = (torch.rand((d,), generator=g) + 0.5).to(dtype=dtype, device=device)
    # Unique slots; every third token is padding (slot -1).
    slots = torch.randperm(nb * bs, generator=g)[:n_tok]
    slots[::3] = -1
    return q, k, v, positions.to(torch.int64), cs, qw, kw, slots.to(device=device, dtype=torch.int64)


def _check(n_tok, hq, hkv, d, bs, nb, dtype, device, with_norm, fused_qkv, rotary_dim=None):
    q, k, v, pos, cs, qw, kw, slots = _case(
        n_tok, hq, hkv, d, bs, nb, dtype, device, with_norm, fused_qkv, rotary_dim=rotary_dim
    )
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    k_cache = poison(torch.empty((nb, bs, hkv, d), dtype=dtype, device=device))
    v_cache = poison(torch.empty_like(k_cache))
    q_out = poison(torch.empty((n_tok, hq, d), dtype=dtype, device=device))
    k_out = poison(torch.empty((n_tok, hkv, d), dtype=dtype, device=device))
    rq, rk = K.qk_norm_rope_store(q, k, v, pos, cs, qw, kw, 1e-6, k_cache, v_cache, slots, q_out=q_out, k_out=k_out)
    assert rq is q_out and rk is k_out
    ref_q, ref_k = ref_qk_norm_rope(q, k, pos, cs, qw, kw, 1e-6)
    t = tol(dtype)
    if interpreting() and dtype == torch.bfloat16:
        t = dict(atol=6e-2, rtol=6e-2)  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
    torch.testing.assert_close(rq.float(), ref_q.float(), **t)
    torch.testing.assert_close(rk.float(), ref_k.float(), **t)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)

    kf, vf = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
    written = torch.zeros(nb * bs, dtype=torch.bool, device=device)
    for i in range(n_tok):
        s = int(slots[i])
        if s < 0:
            continue
        written[s] = True
        assert torch.equal(kf[s], rk[i]), f"k cache slot {s} != rotated k of token {i}"
        assert torch.equal(vf[s], v[i]), f"v cache slot {s} != v of token {i}"
    # slot -1 rows and every slot nobody owns stay untouched (still NaN)
    assert torch.isnan(kf[~written].float()).all() and torch.isnan(vf[~written].float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("shape", SMALL)
def test_qk_norm_rope_store(shape, with_norm, dtype, device):
    _check(*shape[:6], dtype, device, with_norm, fused_qkv=shape[0] % 2 == 1, rotary_dim=(shape[6:] or [None])[0])


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("fused_qkv", [True, False])
@pytest.mark.parametrize("shape", LARGE)
def test_qk_norm_rope_store_large(shape, fused_qkv, with_norm, dtype, device):
    _check(*shape, dtype, device, with_norm, fused_qkv)


@gpu
def test_qk_norm_rope_store_qwen35_partial_rotary(device):
    """Qwen3.5's gated attention: 16 q / 4 kv heads of 256 dims, q/k norm, 64 of 256 dims rotate."""
    _check(300, 16, 4, 256, 16, 40, torch.bfloat16, device, True, True, rotary_dim=64)


def test_only_q_norm_and_fp16(device):
    """q_norm given, k_norm None: only q is normalised."""
    q, k, v, pos, cs, qw, _, slots = _case(4, 2, 1, 16, 4, 2, torch.float16, device, True, False, seed=3)
    kc = poison(torch.empty((2, 4, 1, 16), dtype=torch.float16, device=device))
    vc = poison(torch.empty_like(kc))
    rq, rk = K.qk_norm_rope_store(q, k, v, pos, cs, qw, None, 1e-6, kc, vc, slots)
    ref_q, ref_k = ref_qk_norm_rope(q, k, pos, cs, qw, None, 1e-6)
    torch.testing.assert_close(rq.float(), ref_q.float(), **tol(torch.float16))
    torch.testing.assert_close(rk.float(), ref_k.float(), **tol(torch.float16))


def test_partial_rotary_passes_the_rest_through(device):
    """Without norms, the dims past the rotary ones come out exactly as they went in, and position 0 (cos 1,
    sin 0) leaves the rotary ones unchanged too."""
    q, k, v, _, cs, _, _, slots = _case(3, 2, 1, 32, 4, 2, torch.float32, device, False, False, rotary_dim=8)
    pos = torch.tensor([0, 5, 9], dtype=torch.int64, device=device)
    kc = poison(torch.empty((2, 4, 1, 32), device=device))
    rq, rk = K.qk_norm_rope_store(q, k, v, pos, cs, None, None, 1e-6, kc, poison(torch.empty_like(kc)), slots)
    assert torch.equal(rq[..., 8:], q[..., 8:]) and torch.equal(rk[..., 8:], k[..., 8:])
    assert torch.equal(rq[0], q[0]) and torch.equal(rk[0], k[0])
    assert not torch.equal(rq[1, :, :8], q[1, :, :8])
