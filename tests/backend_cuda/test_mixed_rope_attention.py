"""A mixed step's attention split by rows (`INFER_CUDA_MIXED_ATTENTION_STREAMS=2`): the one-token rows' q/k norm,
RoPE and store inside the ragged decode launch, the chunk rows' in `qk_norm_rope_store(skip_single_token_of=...)`
before the prefill kernel (on a side stream on the GPU). Against the unfused launches (the store kernel over every
row, then both attention kernels) and the plain-torch reference.

Every new token's cache slot holds NaN before the launches, so a kernel that reads a key before it is stored, or a
store to another row's slot, poisons the output or the cache check."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels import attention_decode as A
from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
from infer_core.ports.fused_ops import AttentionBatch
from tests.backend_cuda.conftest import gpu, poison, tol
from tests.backend_cuda.reference import make_cos_sin_cache, make_paged_batch, ref_paged_attention, ref_qk_norm_rope

EPS = 1e-6


class MixedInputs(NamedTuple):
    pb: object  # a PagedBatch whose new tokens' slots hold NaN
    q: torch.Tensor  # the raw projection's rows (padding rows past the batch's included)
    k: torch.Tensor
    v: torch.Tensor
    batch: AttentionBatch
    cos_sin_cache: torch.Tensor
    q_norm_weight: torch.Tensor
    k_norm_weight: torch.Tensor


def _mixed_inputs(q_lens, ctx, hq, hkv, d, bs, dtype, device, seed=0, padding_rows=0) -> MixedInputs:
    """A mixed step: sequence i brings `q_lens[i]` new tokens, the last of its `ctx[i]` (a `q_len` of 0 with a
    `ctx` of 0 is an empty padding sequence); `padding_rows` token rows past the batch have slot -1."""
    pb = make_paged_batch(q_lens, ctx, hq, hkv, d, bs, dtype, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = sum(q_lens) + padding_rows
    qkv = torch.randn((n, (hq + 2 * hkv) * d), generator=g).to(dtype=dtype, device=device)
    q = qkv[:, : hq * d].view(n, hq, d)  # strided views of one projection, as the model hands them over
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    positions, slots = [], []
    for i, (ql, c) in enumerate(zip(q_lens, ctx)):
        for pos in range(c - ql, c):
            page = int(pb.block_tables[i, pos // bs])
            positions.append(pos)
            slots.append(page * bs + pos % bs)
            pb.k_cache[page, pos % bs] = float("nan")  # the new tokens' slots: stored by the launches
            pb.v_cache[page, pos % bs] = float("nan")
    positions += [0] * padding_rows
    slots += [-1] * padding_rows
    batch = AttentionBatch(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=pb.query_start_loc, seq_lens=pb.seq_lens, block_tables=pb.block_tables,
        max_query_len=max(q_lens), max_seq_len=max(ctx), is_decode=False, block_size=bs,
    )
    cs = make_cos_sin_cache(8192, d, device=device)
    qw = (torch.rand(d, generator=g) + 0.5).to(dtype=dtype, device=device)
    kw = (torch.rand(d, generator=g) + 0.5).to(dtype=dtype, device=device)
    return MixedInputs(pb, q, k, v, batch, cs, qw, kw)


def _single_rows(q_lens) -> list[int]:
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    return [s for s, ql in zip(starts, q_lens) if ql == 1]


def _store(m: MixedInputs, k_cache, v_cache, **kwargs):
    return K.qk_norm_rope_store(m.q, m.k, m.v, m.batch.positions, m.cos_sin_cache, m.q_norm_weight, m.k_norm_weight,
                                EPS, k_cache, v_cache, m.batch.slot_mapping, **kwargs)


SMALL = ([1, 6, 1, 0, 1, 3], [9, 11, 26, 0, 1, 40], 4, 2, 16, 4)  # an empty sequence, a one-token context


def test_the_store_kernel_leaves_the_one_token_rows_alone(device):
    """With `skip_single_token_of`, the chunk rows are stored and rotated exactly as without it; the one-token rows'
    q / k outputs stay as they were and their slots unwritten."""
    q_lens, ctx, hq, hkv, d, bs = SMALL
    m = _mixed_inputs(q_lens, ctx, hq, hkv, d, bs, torch.float32, device, seed=3, padding_rows=2)
    k_all, v_all = m.pb.k_cache.clone(), m.pb.v_cache.clone()
    q_all, k_rot_all = _store(m, k_all, v_all)
    q_out, k_out = poison(torch.empty_like(q_all)), poison(torch.empty_like(k_rot_all))
    _store(m, m.pb.k_cache, m.pb.v_cache, q_out=q_out, k_out=k_out, skip_single_token_of=m.batch.query_start_loc)
    single = torch.zeros(q_all.shape[0], dtype=torch.bool)
    single[_single_rows(q_lens)] = True
    assert torch.isnan(q_out[single]).all() and torch.isnan(k_out[single]).all()
    assert torch.equal(q_out[~single], q_all[~single]) and torch.equal(k_out[~single], k_rot_all[~single])
    slots = m.batch.slot_mapping.cpu()
    flat_k, flat_all = m.pb.k_cache.view(-1, hkv, d).cpu(), k_all.view(-1, hkv, d).cpu()
    assert torch.isnan(flat_k[slots[single]]).all()  # the decode kernel's to store
    chunk_slots = slots[~single & (slots >= 0)]
    assert torch.equal(flat_k[chunk_slots], flat_all[chunk_slots])
    assert torch.equal(m.pb.v_cache.view(-1, hkv, d).cpu()[chunk_slots], v_all.view(-1, hkv, d).cpu()[chunk_slots])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_decode_launch_rotates_and_stores_its_own_rows(dtype, device):
    """The ragged decode launch with a `DecodeRope` equals the store kernel followed by the plain ragged decode
    launch on the one-token rows (outputs and their cache slots), and writes no other row."""
    q_lens, ctx, hq, hkv, d, bs = SMALL
    m = _mixed_inputs(q_lens, ctx, hq, hkv, d, bs, dtype, device, seed=5)
    k_ref, v_ref = m.pb.k_cache.clone(), m.pb.v_cache.clone()
    q_rot, _ = _store(m, k_ref, v_ref)
    qsl = m.batch.query_start_loc
    expected = K.paged_attention_decode(q_rot, k_ref, v_ref, m.pb.seq_lens, m.pb.block_tables, 0.3,
                                        query_start_loc=qsl)
    rope = A.DecodeRope(m.k, m.v, m.batch.positions, m.cos_sin_cache, m.q_norm_weight, m.k_norm_weight, EPS,
                        m.batch.slot_mapping)
    out = poison(torch.empty_like(m.q))
    K.paged_attention_decode(m.q, m.pb.k_cache, m.pb.v_cache, m.pb.seq_lens, m.pb.block_tables, 0.3, out=out,
                             query_start_loc=qsl, rope=rope)
    rows = _single_rows(q_lens)
    others = [r for r in range(m.q.shape[0]) if r not in rows]
    t = tol(dtype) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(out[rows].float(), expected[rows].float(), **t)
    assert torch.isnan(out[others]).all()
    slots = m.batch.slot_mapping[rows]
    torch.testing.assert_close(m.pb.k_cache.view(-1, hkv, d)[slots].float(), k_ref.view(-1, hkv, d)[slots].float(),
                               **t)
    assert torch.equal(m.pb.v_cache.view(-1, hkv, d)[slots], v_ref.view(-1, hkv, d)[slots])


def _port_call(m: MixedInputs, k_cache, v_cache, scale):
    return TritonFusedOps(CudaMathOps()).qk_norm_rope_attention(
        m.q, m.k, m.v, m.batch.positions, m.cos_sin_cache, m.q_norm_weight, m.k_norm_weight, EPS, k_cache, v_cache,
        m.batch, scale,
    )


def _check_port_split_by_rows(m: MixedInputs, dtype, monkeypatch, scale):
    """The port op with the split (mode 2) against mode 0 (the store kernel over every row, then both attention
    kernels) and the plain-torch reference: outputs of the batch's rows and every cache slot."""
    import infer_backend_cuda.ops as O

    k0, v0 = m.pb.k_cache.clone(), m.pb.v_cache.clone()
    monkeypatch.setattr(O, "MIXED_STREAMS_MODE", 0)
    monkeypatch.setattr(O, "MIXED_STREAMS", False)
    one = _port_call(m, k0, v0, scale)
    monkeypatch.setattr(O, "MIXED_STREAMS_MODE", 2)
    two = _port_call(m, m.pb.k_cache, m.pb.v_cache, scale)
    n = sum(m.pb.q_lens)
    t = tol(dtype) if dtype == torch.float32 or m.q.is_cuda else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(two[:n].float(), one[:n].float(), **t)
    torch.testing.assert_close(m.pb.k_cache.nan_to_num(7.0).float(), k0.nan_to_num(7.0).float(), **t)
    assert torch.equal(m.pb.v_cache.nan_to_num(7.0), v0.nan_to_num(7.0))
    ref_q, _ = ref_qk_norm_rope(m.q[:n], m.k[:n], m.batch.positions[:n], m.cos_sin_cache, m.q_norm_weight,
                                m.k_norm_weight, EPS)
    m.pb.q = ref_q
    torch.testing.assert_close(two[:n].float().cpu(), ref_paged_attention(m.pb, scale).float(), **t)
    return two


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_port_op_split_by_rows_equals_the_unfused_launches(dtype, device, monkeypatch):
    q_lens, ctx, hq, hkv, d, bs = SMALL
    m = _mixed_inputs(q_lens, ctx, hq, hkv, d, bs, dtype, device, seed=9, padding_rows=3)
    _check_port_split_by_rows(m, dtype, monkeypatch, 0.3)


def test_port_op_keeps_an_output_gate_on_the_unfused_launches(device, monkeypatch):
    """A gated attention's mixed step (Qwen3.5) is not split by rows: the gate multiplies every row's output."""
    import infer_backend_cuda.ops as O

    q_lens, ctx, hq, hkv, d, bs = SMALL
    m = _mixed_inputs(q_lens, ctx, hq, hkv, d, bs, torch.float32, device, seed=11)
    monkeypatch.setattr(O, "MIXED_STREAMS_MODE", 2)
    calls = []
    monkeypatch.setattr(TritonFusedOps, "_mixed_on_two_streams", staticmethod(lambda *a: calls.append(a)))
    gate = torch.randn_like(m.q)
    y = TritonFusedOps(CudaMathOps()).qk_norm_rope_attention(
        m.q, m.k, m.v, m.batch.positions, m.cos_sin_cache, m.q_norm_weight, m.k_norm_weight, EPS, m.pb.k_cache,
        m.pb.v_cache, m.batch, 0.3, output_gate=gate,
    )
    assert calls == [] and y.shape == m.q.shape and not torch.isnan(y[: sum(q_lens)]).any()


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chat_shaped_mixed_step_split_by_rows_on_two_streams(monkeypatch):
    """Qwen3-4B heads, a 40-token chunk beside 24 decodes at scattered contexts, 8 padding rows: the split on two
    streams equals mode 0 and the reference; as a replayed CUDA graph it equals the eager run bit for bit."""
    q_lens = [1] * 24 + [40]
    ctx = [50 + 37 * i for i in range(24)] + [230]
    m = _mixed_inputs(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=21, padding_rows=8)
    fresh = (m.pb.k_cache.clone(), m.pb.v_cache.clone())
    eager = _check_port_split_by_rows(m, torch.bfloat16, monkeypatch, 128**-0.5)
    torch.cuda.synchronize()

    caches = (fresh[0].clone(), fresh[1].clone())
    static_out = torch.empty_like(eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as the backend's capture_graph does
        static_out.copy_(_port_call(m, *caches, 128**-0.5))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(_port_call(m, *caches, 128**-0.5))
    poison(static_out)
    caches[0].copy_(fresh[0])
    caches[1].copy_(fresh[1])
    graph.replay()
    torch.cuda.synchronize()
    n = sum(q_lens)
    assert torch.equal(static_out[:n], eager[:n])
    assert torch.equal(caches[0].nan_to_num(7.0), m.pb.k_cache.nan_to_num(7.0))


@pytest.mark.parametrize(("raw", "mode"), [("0", 0), ("1", 1), (" 2 ", 2), ("", 2)])
def test_the_switch_takes_zero_one_or_two(raw, mode, monkeypatch):
    import importlib

    import infer_backend_cuda.ops as O

    monkeypatch.setenv(O.MIXED_STREAMS_ENV, raw)
    try:
        assert importlib.reload(O).MIXED_STREAMS_MODE == mode and O.MIXED_STREAMS == (mode >= 1)
        monkeypatch.setenv(O.MIXED_STREAMS_ENV, "on")
        with pytest.raises(ValueError, match="INFER_CUDA_MIXED_ATTENTION_STREAMS='on': 0, 1 or 2"):
            importlib.reload(O)
    finally:
        monkeypatch.delenv(O.MIXED_STREAMS_ENV)
        importlib.reload(O)
