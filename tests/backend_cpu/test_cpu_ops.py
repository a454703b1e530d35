"""The CPU reference ops against straightforward torch formulas (HF's layouts), on random data."""

from __future__ import annotations

import math
from importlib.metadata import entry_points

import pytest
import torch
import torch.nn.functional as F

from infer_backend_cpu import CpuBackend
from infer_core.dtypes import DType
from infer_core.ports import AttentionBatch, LlmBackend
from infer_core.quant import DENSE

BACKEND = CpuBackend(device="cpu")
OPS = BACKEND.ops


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() / torch.sqrt(variance + eps)).to(x.dtype)


# ---------------------------------------------------------------- backend surface


def test_backend_is_found_through_its_entry_point() -> None:
    (entry,) = [ep for ep in entry_points(group="rustinfer.backends") if ep.name == "cpu"]
    assert entry.load() is CpuBackend


def test_backend_surface() -> None:
    backend: LlmBackend = CpuBackend(device="")
    assert (backend.name, backend.device, backend.supports_graphs, backend.host_memory) == ("cpu", "cpu", False, True)
    assert backend.default_dtype() is DType.FLOAT32
    assert CpuBackend(dtype="auto").default_dtype() is DType.FLOAT32
    assert CpuBackend(dtype=DType.BFLOAT16).default_dtype() is DType.BFLOAT16
    assert backend.torch_dtype(DType.BFLOAT16) is torch.bfloat16
    info = backend.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    backend.reset_peak_memory()
    assert backend.peak_memory_bytes() >= 0
    backend.synchronize()
    with pytest.raises(NotImplementedError, match="graph"):
        backend.capture_graph(lambda: None)
    with pytest.raises(ValueError, match="cpu"):
        CpuBackend(device="cuda:0")
    x = _randn(3, 4, seed=0)
    assert backend.ops.collective.world_size == 1 and backend.ops.collective.all_reduce(x) is x


def test_allocate_kv_cache_shapes() -> None:
    caches = BACKEND.allocate_kv_cache(3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=DType.BFLOAT16)
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, 4, 2, 8) and k.dtype == v.dtype == torch.bfloat16
        assert k.data_ptr() != v.data_ptr()


# ---------------------------------------------------------------- math


def test_math_ops() -> None:
    x, w, b = _randn(5, 16, seed=1), _randn(24, 16, seed=2), _randn(24, seed=3)
    torch.testing.assert_close(OPS.math.linear(x, w, b), x @ w.T + b)
    torch.testing.assert_close(OPS.math.linear(x, w), x @ w.T)
    ids = torch.tensor([3, 0, 23, 3])
    torch.testing.assert_close(OPS.math.embedding(ids, w), w[ids])
    logits = _randn(4, 50, seed=4)
    assert OPS.math.argmax(logits).tolist() == [int(row.argmax()) for row in logits]


# ---------------------------------------------------------------- norms and activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_add(dtype: torch.dtype) -> None:
    x, residual = _randn(7, 48, seed=5, dtype=dtype), _randn(7, 48, seed=6, dtype=dtype)
    weight = (1 + 0.5 * _randn(48, seed=7)).to(dtype)
    torch.testing.assert_close(OPS.fused.rms_norm(x, weight, 1e-6), _reference_rms_norm(x, weight, 1e-6))
    normed, new_residual = OPS.fused.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, _reference_rms_norm(x + residual, weight, 1e-5))
    assert normed.dtype == new_residual.dtype == dtype


def test_silu_and_mul() -> None:
    gate_up = _randn(6, 2 * 40, seed=8)
    torch.testing.assert_close(OPS.fused.silu_and_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:])


def test_norm_and_activation_fused_with_the_next_projection() -> None:
    x, residual = _randn(5, 48, seed=9), _randn(5, 48, seed=10)
    norm_w, w, b = 1 + 0.5 * _randn(48, seed=11), _randn(24, 48, seed=12), _randn(24, seed=13)
    y, stream = OPS.fused.add_rms_norm_linear(x, residual, norm_w, 1e-5, w, b)
    torch.testing.assert_close(stream, x + residual)
    torch.testing.assert_close(y, _reference_rms_norm(x + residual, norm_w, 1e-5) @ w.T + b)
    y0, stream0 = OPS.fused.add_rms_norm_linear(x, None, norm_w, 1e-5, w, None)
    assert stream0 is x
    torch.testing.assert_close(y0, _reference_rms_norm(x, norm_w, 1e-5) @ w.T)
    w_gate_up = _randn(2 * 24, 48, seed=15)
    act, stream = OPS.linears.bind(DENSE).add_rms_norm_linear_silu_mul(x, residual, norm_w, 1e-5, (w_gate_up,), None)
    gate_up = _reference_rms_norm(x + residual, norm_w, 1e-5) @ w_gate_up.T
    torch.testing.assert_close(stream, x + residual)
    torch.testing.assert_close(act, F.silu(gate_up[:, :24]) * gate_up[:, 24:])


# ---------------------------------------------------------------- qk-norm + rope + store


def _reference_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's formulation: x * cos + rotate_half(x) * sin with the angle table repeated over both halves."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    rotated_half = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
    return x * emb.cos() + rotated_half * emb.sin()


def _cos_sin_cache(dim: int, max_pos: int, theta: float) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_store(with_norm: bool) -> None:
    num_tokens, hq, hkv, dim, block_size, num_blocks = 6, 4, 2, 16, 4, 5
    q, k, v = _randn(num_tokens, hq, dim, seed=9), _randn(num_tokens, hkv, dim, seed=10), _randn(num_tokens, hkv, dim, seed=11)
    positions = torch.tensor([0, 5, 6, 17, 3, 40])
    q_w = 1 + 0.3 * _randn(dim, seed=12) if with_norm else None
    k_w = 1 + 0.3 * _randn(dim, seed=13) if with_norm else None
    k_cache = _randn(num_blocks, block_size, hkv, dim, seed=14)  # non-zero: unwritten slots must keep it
    v_cache = _randn(num_blocks, block_size, hkv, dim, seed=15)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([7, -1, 0, 19, -1, 12])

    q_out, k_out = OPS.fused.qk_norm_rope_store(
        q, k, v, positions, _cos_sin_cache(dim, 64, 10000.0), q_w, k_w, 1e-6, k_cache, v_cache, slots
    )

    q_ref = _reference_rms_norm(q, q_w, 1e-6) if q_w is not None else q
    k_ref = _reference_rms_norm(k, k_w, 1e-6) if k_w is not None else k
    q_ref, k_ref = _reference_rope(q_ref, positions, 10000.0), _reference_rope(k_ref, positions, 10000.0)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)

    flat_k, flat_v = k_cache.view(-1, hkv, dim), v_cache.view(-1, hkv, dim)
    written = slots >= 0
    torch.testing.assert_close(flat_k[slots[written]], k_ref[written], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flat_v[slots[written]], v[written])  # v is stored as is
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.equal(flat_k[untouched], k_before.view(-1, hkv, dim)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view(-1, hkv, dim)[untouched])


def test_partial_rotary_rotates_only_the_table_width() -> None:
    """A table of width R < D rotates dims :R as transformers' Qwen3.5 attention does and leaves the rest."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    num_tokens, heads, dim, rotary = 5, 2, 32, 8
    q, k, v = _randn(num_tokens, heads, dim, seed=30), _randn(num_tokens, heads, dim, seed=31), _randn(num_tokens, heads, dim, seed=32)
    positions = torch.tensor([0, 3, 9, 10, 60])
    cache = _cos_sin_cache(rotary, 64, 1e7)
    k_cache, v_cache = torch.zeros(2, 4, heads, dim), torch.zeros(2, 4, heads, dim)
    q_out, k_out = OPS.fused.qk_norm_rope_store(q, k, v, positions, cache, None, None, 1e-6, k_cache, v_cache,
                                                torch.arange(num_tokens))
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1)[None], torch.cat((sin, sin), dim=-1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(q_out[..., rotary:], q[..., rotary:])


# ---------------------------------------------------------------- paged attention


def _paged_case(
    query_lens: list[int], context_lens: list[int], hq: int, hkv: int, dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Random contexts written into scrambled pages; returns q, caches, the batch and each dense (k, v)."""
    max_blocks = max(math.ceil(c / block_size) for c in context_lens) + 1
    num_blocks = sum(math.ceil(c / block_size) for c in context_lens) + 3
    k_cache = _randn(num_blocks, block_size, hkv, dim, seed=seed)
    v_cache = _randn(num_blocks, block_size, hkv, dim, seed=seed + 1)
    pages = torch.randperm(num_blocks, generator=_gen(seed + 2)).tolist()
    block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    dense = []
    for i, context in enumerate(context_lens):
        n = math.ceil(context / block_size)
        block_tables[i, :n] = torch.tensor([pages.pop() for _ in range(n)], dtype=torch.int32)
        slots = (block_tables[i, :n, None].long() * block_size + torch.arange(block_size)).reshape(-1)[:context]
        dense.append((k_cache.view(-1, hkv, dim)[slots], v_cache.view(-1, hkv, dim)[slots]))
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    q = _randn(int(qsl[-1]), hq, dim, seed=seed + 3)
    batch = AttentionBatch(
        positions=torch.zeros(int(qsl[-1]), dtype=torch.int64),  # unused by attention
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
        is_decode=all(n == 1 for n in query_lens),
        block_size=block_size,
    )
    return q, k_cache, v_cache, batch, dense


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with an explicit mask: the query rows are the *last* len(q) tokens of the context."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    prefix = k.shape[0] - q.shape[0]
    allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=prefix)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_paged_attention_ragged_with_prefix(hq: int, hkv: int) -> None:
    # Fresh prefill, prefill over a cached prefix (chunked / prefix-cache), decode, and a one-token prefill.
    query_lens, context_lens = [5, 3, 1, 1, 7], [5, 11, 9, 1, 13]
    dim, scale = 16, 16**-0.5
    q, k_cache, v_cache, batch, dense = _paged_case(query_lens, context_lens, hq, hkv, dim, block_size=4, seed=20)
    out = OPS.fused.paged_attention(q, k_cache, v_cache, batch, scale)
    starts = batch.query_start_loc.tolist()
    for i, (k, v) in enumerate(dense):
        rows = slice(starts[i], starts[i + 1])
        torch.testing.assert_close(out[rows], _reference_attention(q[rows], k, v, scale), atol=1e-5, rtol=1e-5)


def test_paged_attention_decode_batch_and_padding_rows() -> None:
    """A decode batch padded like a captured graph: the padding row (length 0) yields zeros, others unaffected."""
    q, k_cache, v_cache, batch, dense = _paged_case([1, 1, 1], [6, 17, 2], 4, 2, 8, block_size=4, seed=30)
    padded = batch._replace(
        query_start_loc=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([6, 17, 2, 0], dtype=torch.int32),
        block_tables=torch.cat((batch.block_tables, torch.full((1, batch.block_tables.shape[1]), -1, dtype=torch.int32))),
    )
    q_padded = torch.cat((q, _randn(1, 4, 8, seed=31)))
    out = OPS.fused.paged_attention(q_padded, k_cache, v_cache, padded, 0.3)
    for i, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[i : i + 1], _reference_attention(q[i : i + 1], k, v, 0.3), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3], torch.zeros(4, 8))
