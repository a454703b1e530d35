"""The decode attention with the q/k norm, RoPE and KV store in its split pass and the split merge by the last
program (`attention_decode.py`'s two fusions), against the unfused launches and a plain-torch reference.

Caches hold NaN outside every context and at each new token's slot before the launch, so a program that reads
the new token's k / v before it is stored, or a store to the wrong slot, poisons the output or the check."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels import attention_decode as A
from infer_backend_cuda.kernels import split_k
from infer_backend_cuda.kernels._common import interpreting
from infer_backend_cpu.fused_ops import CpuFusedOps
from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
from infer_core.ports.fused_ops import AttentionBatch
from tests.backend_cuda.conftest import gpu, poison, tol
from tests.backend_cuda.reference import make_cos_sin_cache, make_paged_batch, ref_paged_attention, ref_qk_norm_rope

EPS = 1e-6
# (ctx_lens, Hq, Hkv, head_dim, rotary_dim, block_size, num_splits, qk_norm); ctx 0 is a padding row (slot -1)
SMALL = [
    ([1, 9, 33, 0], 2, 2, 16, 16, 4, 3, True),  # a one-token context: its only key is the new one
    ([20, 5, 0], 4, 2, 32, 32, 8, 1, True),  # one split: no merge
    ([40, 17], 4, 1, 32, 8, 16, 4, False),  # partial rotary, no q/k norm
    ([3, 64, 16], 8, 2, 16, 16, 8, None, True),  # the default split count
    ([50, 7], 6, 2, 64, 16, 4, 5, True),  # GQA 3, partial rotary (Qwen3.5-like), a page of 4
]
LARGE = [
    ([279], 32, 8, 128, 128, 16, None, True),  # Qwen3-4B at batch 1: 32 splits, 5 of them used
    ([1, 17, 4000, 0, 513, 2048, 100, 31], 32, 8, 128, 128, 16, None, True),
    ([300, 77, 1000, 2], 16, 4, 256, 64, 16, None, True),  # Qwen3.5-4B's attention
    ([1000] * 40, 32, 8, 128, 128, 16, None, True),  # one split (>= 33 sequences at 8 KV heads)
]


def _inputs(case, dtype, device, seed=0):
    ctx, hq, hkv, d, rot, bs, splits, norm = case
    pb = make_paged_batch([1] * len(ctx), ctx, hq, hkv, d, bs, dtype, device, seed=seed + d + len(ctx))
    g = torch.Generator().manual_seed(seed + 1)
    n = len(ctx)
    qkv = torch.randn((n, (hq + 2 * hkv) * d), generator=g).to(dtype=dtype, device=device)
    q = qkv[:, : hq * d].view(n, hq, d)  # strided views of one projection, as the model hands them over
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    positions = torch.tensor([max(c - 1, 0) for c in ctx], dtype=torch.int64, device=device)
    slots = []
    for i, c in enumerate(ctx):
        if c == 0:
            slots.append(-1)
            continue
        page = int(pb.block_tables[i, (c - 1) // bs])
        slots.append(page * bs + (c - 1) % bs)
        pb.k_cache[page, (c - 1) % bs] = float("nan")  # the new token's slot: the kernel must store it first
        pb.v_cache[page, (c - 1) % bs] = float("nan")
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    cs = make_cos_sin_cache(8192, rot, device=device)
    qw = kw = None
    if norm:
        qw = (torch.rand(d, generator=g) + 0.5).to(dtype=dtype, device=device)
        kw = (torch.rand(d, generator=g) + 0.5).to(dtype=dtype, device=device)
    rope = A.DecodeRope(k, v, positions, cs, qw, kw, EPS, slot_mapping)
    return pb, q, rope, splits


def _tol(dtype):
    if interpreting() and dtype == torch.bfloat16:
        return dict(atol=6e-2, rtol=6e-2)  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
    return tol(dtype)


def _check(case, dtype, device):
    pb, q, rope, splits = _inputs(case, dtype, device)
    d = q.shape[-1]
    scale = d**-0.5
    q0 = q.clone()
    # unfused: the store kernel, then attention with the reduce pass
    k_ref, v_ref = pb.k_cache.clone(), pb.v_cache.clone()
    rq, rk = K.qk_norm_rope_store(q, rope.k, rope.v, rope.positions, rope.cos_sin_cache, rope.q_norm_weight,
                                  rope.k_norm_weight, EPS, k_ref, v_ref, rope.slot_mapping)
    unfused = K.paged_attention_decode(rq, k_ref, v_ref, pb.seq_lens, pb.block_tables, scale, num_splits=splits,
                                       merge_in_kernel=False)

    out = poison(torch.empty_like(q0))
    fused = K.paged_attention_decode(q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, scale, out=out,
                                     num_splits=splits, rope=rope)
    assert fused is out and torch.equal(q, q0)
    t = _tol(dtype)
    torch.testing.assert_close(fused.float(), unfused.float(), **t)
    # the plain-torch reference: rotate, store, attend
    ref_q, ref_k = ref_qk_norm_rope(q0, rope.k, rope.positions, rope.cos_sin_cache, rope.q_norm_weight,
                                    rope.k_norm_weight, EPS)
    assert torch.isnan(pb.k_cache).sum() == torch.isnan(k_ref).sum()  # no slot written but the new tokens'
    assert torch.equal(pb.v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    torch.testing.assert_close(pb.k_cache.nan_to_num(7.0).float(), k_ref.nan_to_num(7.0).float(), **t)
    stored = pb.k_cache.view(-1, *pb.k_cache.shape[2:])[rope.slot_mapping.clamp(min=0)]
    live = rope.slot_mapping >= 0
    torch.testing.assert_close(stored[live].float(), ref_k[live].float(), **t)
    pb.q = ref_q
    torch.testing.assert_close(fused.float().cpu(), ref_paged_attention(pb, scale).float(), **t)
    counters = split_k.counters(torch.device(device))
    if counters is not None:
        assert int(counters.count_nonzero()) == 0  # every merge set its counter back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SMALL)
def test_fused_decode_attention(case, dtype, device):
    _check(case, dtype, device)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", LARGE)
def test_fused_decode_attention_large(case, dtype, device):
    _check(case, dtype, device)


def _hnd_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache's values in `[blocks, Hkv, page, D]` storage, viewed as the kernel's `[blocks, page, Hkv, D]`."""
    out = torch.empty((cache.shape[0], cache.shape[2], cache.shape[1], cache.shape[3]), dtype=cache.dtype,
                      device=cache.device).transpose(1, 2)
    return out.copy_(cache)


@pytest.mark.parametrize(("heads_fastest", "layout"), [(True, "nhd"), (False, "hnd"), (True, "hnd")])
@pytest.mark.parametrize("case", [SMALL[0], SMALL[3], SMALL[4]])
def test_grid_order_and_cache_layout_change_no_bit(case, heads_fastest, layout, device, monkeypatch):
    """The KV heads fastest in the grid (`INFER_CUDA_DECODE_HEADS_FASTEST`) and a head-major page layout, given as
    strides, run the same programs' arithmetic: outputs and stored tokens equal the sequences-fastest launch's bit
    for bit."""
    _check_grid_order(case, torch.float32, heads_fastest, layout, device, monkeypatch)


@gpu
@pytest.mark.parametrize(("heads_fastest", "layout"), [(True, "nhd"), (True, "hnd")])
@pytest.mark.parametrize("case", [LARGE[1], ([300, 2000], 32, 8, 128, 128, 16, None, True)])
def test_grid_order_and_cache_layout_change_no_bit_on_the_gpu(case, heads_fastest, layout, device, monkeypatch):
    """As above with the programs running at once (the interpreter runs a (sequence, head)'s splits in a row): with
    more KV heads than sequences, a merge counter indexed by the wrong grid axis would be shared by two groups."""
    _check_grid_order(case, torch.bfloat16, heads_fastest, layout, device, monkeypatch)


def _check_grid_order(case, dtype, heads_fastest, layout, device, monkeypatch):
    pb, q, rope, splits = _inputs(case, dtype, device)
    scale = q.shape[-1] ** -0.5
    base_k, base_v = pb.k_cache.clone(), pb.v_cache.clone()
    monkeypatch.setattr(A, "HEADS_FASTEST", False)
    base = K.paged_attention_decode(q, base_k, base_v, pb.seq_lens, pb.block_tables, scale, num_splits=splits,
                                    rope=rope)
    k, v = (_hnd_view(c) for c in (pb.k_cache, pb.v_cache)) if layout == "hnd" else (pb.k_cache, pb.v_cache)
    monkeypatch.setattr(A, "HEADS_FASTEST", heads_fastest)
    out = K.paged_attention_decode(q, k, v, pb.seq_lens, pb.block_tables, scale, num_splits=splits, rope=rope)
    assert torch.equal(out, base)
    assert torch.equal(k.nan_to_num(7.0), base_k.nan_to_num(7.0))  # the new tokens stored at their slots only
    assert torch.equal(v.nan_to_num(7.0), base_v.nan_to_num(7.0))
    counters = split_k.counters(torch.device(device))
    if counters is not None:
        assert int(counters.count_nonzero()) == 0


def test_the_merge_in_kernel_equals_the_reduce_pass(device):
    """The last program's merge and the reduce kernel sum the same partials in the same order."""
    pb = make_paged_batch([1] * 4, [1, 90, 33, 0], 8, 2, 32, 8, torch.float32, device, seed=9)
    args = (pb.q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, 0.2)
    merged = K.paged_attention_decode(*args, num_splits=6)
    reduced = K.paged_attention_decode(*args, num_splits=6, merge_in_kernel=False)
    assert torch.equal(merged, reduced)
    assert torch.equal(merged[3], torch.zeros_like(merged[3]))  # the padding row


def test_fused_refuses_mismatched_k(device):
    pb, q, rope, _ = _inputs(SMALL[0], torch.float32, device)
    args = (q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, 0.25)
    with pytest.raises(ValueError, match="do not match"):
        K.paged_attention_decode(*args, rope=rope._replace(k=rope.k[:, :1]))


def _port_inputs(qk_norm: bool, device: str, seed: int):
    """A decode batch for the port op: its inputs on the device and a CPU copy (batch, rope arguments, caches)."""
    pb, q, rope, _ = _inputs(([5, 30, 0, 12], 4, 2, 32, 16, 4, None, qk_norm), torch.float32, device, seed=seed)
    batch = AttentionBatch(
        positions=rope.positions, slot_mapping=rope.slot_mapping, query_start_loc=pb.query_start_loc,
        seq_lens=pb.seq_lens, block_tables=pb.block_tables, max_query_len=1, max_seq_len=30, is_decode=True,
        block_size=pb.block_size,
    )
    cpu_caches = (pb.k_cache.cpu().clone(), pb.v_cache.cpu().clone())
    cpu_batch = AttentionBatch(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in batch))
    args = (rope.positions, rope.cos_sin_cache, rope.q_norm_weight, rope.k_norm_weight, EPS)
    cpu_args = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in args)
    return pb, q, rope, batch, args, cpu_batch, cpu_args, cpu_caches


@pytest.mark.parametrize("qk_norm", [True, False])
def test_port_op_equals_the_cpu_reference(qk_norm, device):
    """`FusedOps.qk_norm_rope_attention` on a decode batch: the CUDA adapter's one launch against the CPU
    adapter's two ops, outputs and caches."""
    pb, q, rope, batch, args, cpu_batch, cpu_args, cpu_caches = _port_inputs(qk_norm, device, seed=3)
    expected = CpuFusedOps().qk_norm_rope_attention(q.cpu(), rope.k.cpu(), rope.v.cpu(), *cpu_args, *cpu_caches,
                                                    cpu_batch, 0.3)
    got = TritonFusedOps(CudaMathOps()).qk_norm_rope_attention(q, rope.k, rope.v, *args, pb.k_cache, pb.v_cache,
                                                              batch, 0.3)
    torch.testing.assert_close(got.cpu(), expected, **tol(torch.float32))
    torch.testing.assert_close(pb.k_cache.cpu().nan_to_num(7.0), cpu_caches[0].nan_to_num(7.0), **tol(torch.float32))
    assert torch.equal(pb.v_cache.cpu().nan_to_num(7.0), cpu_caches[1].nan_to_num(7.0))


def test_fused_takes_per_token_rotary_rows(device):
    """Multimodal RoPE hands the step its own rotary rows (`AttentionBatch.rope_cos_sin`): positions `0..B-1` into a
    `[B, R]` table. The fused launch rotates by those rows exactly as the store kernel does."""
    pb, q, rope, _ = _inputs(SMALL[4], torch.float32, device, seed=5)
    rows = rope.cos_sin_cache[torch.tensor([70, 3], device=device)]  # any rows, not the tokens' positions
    rope = rope._replace(positions=torch.arange(2, device=device), cos_sin_cache=rows)
    k_ref, v_ref = pb.k_cache.clone(), pb.v_cache.clone()
    rq, _ = K.qk_norm_rope_store(q, rope.k, rope.v, rope.positions, rows, rope.q_norm_weight, rope.k_norm_weight,
                                 EPS, k_ref, v_ref, rope.slot_mapping)
    unfused = K.paged_attention_decode(rq, k_ref, v_ref, pb.seq_lens, pb.block_tables, 0.125, num_splits=5)
    fused = K.paged_attention_decode(q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, 0.125, num_splits=5,
                                     rope=rope)
    torch.testing.assert_close(fused, unfused, **tol(torch.float32))
    torch.testing.assert_close(pb.k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0), **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits, merge_in_kernel", [(1, True), (3, True), (3, False)],
                         ids=["one-split", "merge-in-kernel", "reduce-pass"])
def test_output_gate_equals_the_separate_gate_kernel(splits, merge_in_kernel, dtype, device):
    """Qwen3.5's output gate applied where each path writes the output (the one split's store, the last program's
    merge, the reduce kernel) equals `sigmoid_gate_mul` after the ungated launch bit for bit; the gate is read
    through a strided view of the projection, and a padding row stays zero."""
    pb = make_paged_batch([1] * 4, [1, 90, 33, 0], 8, 2, 32, 8, dtype, device, seed=11)
    g = torch.Generator().manual_seed(12)
    projection = (torch.randn((4, 8, 2, 32), generator=g) * 3).to(dtype=dtype, device=device)
    gate = projection[:, :, 1]  # [query | gate] per head, as q_proj holds them
    args = (pb.q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, 0.2)
    ungated = K.paged_attention_decode(*args, num_splits=splits, merge_in_kernel=merge_in_kernel)
    gated = K.paged_attention_decode(*args, num_splits=splits, merge_in_kernel=merge_in_kernel, output_gate=gate)
    assert torch.equal(gated, K.sigmoid_gate_mul(ungated, gate))
    assert not torch.equal(gated, ungated)
    assert torch.equal(gated[3], torch.zeros_like(gated[3]))
    with pytest.raises(ValueError, match="output gate"):
        K.paged_attention_decode(*args, output_gate=gate[:, :1])


def test_port_op_applies_the_output_gate_as_the_cpu_reference(device):
    """`FusedOps.qk_norm_rope_attention` with an output gate: the CUDA adapter's one launch against the CPU
    adapter's separate ops (attention, then `sigmoid_gate_mul`)."""
    pb, q, rope, batch, args, cpu_batch, cpu_args, cpu_caches = _port_inputs(True, device, seed=4)
    gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device) * 2
    cpu = CpuFusedOps()
    ungated = cpu.qk_norm_rope_attention(q.cpu(), rope.k.cpu(), rope.v.cpu(), *cpu_args,
                                         *(c.clone() for c in cpu_caches), cpu_batch, 0.3)
    expected = cpu.qk_norm_rope_attention(q.cpu(), rope.k.cpu(), rope.v.cpu(), *cpu_args, *cpu_caches, cpu_batch, 0.3,
                                          gate.cpu())
    torch.testing.assert_close(expected, cpu.sigmoid_gate_mul(ungated, gate.cpu()), atol=0, rtol=0)
    got = TritonFusedOps(CudaMathOps()).qk_norm_rope_attention(q, rope.k, rope.v, *args, pb.k_cache, pb.v_cache,
                                                              batch, 0.3, gate)
    torch.testing.assert_close(got.cpu(), expected, **tol(torch.float32))
