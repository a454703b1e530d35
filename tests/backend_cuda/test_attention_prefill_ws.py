"""The warp-specialised Gluon prefill attention (kernels/attention_prefill_ws.py): compiled for sm_90 without a GPU
(Gluon kernels do not run under the interpreter), its stages handed over by TMA and mbarriers and its value MMA kept
in flight across the softmax; on the GPU, against the plain torch reference and the Triton kernel, over the shapes
where its masks, pages and stages are easiest to get wrong."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels import attention_prefill as A
from infer_backend_cuda.kernels import attention_prefill_ws as W
from tests.backend_cuda.conftest import gpu, needs_cuda, poison, tol
from tests.backend_cuda.reference import make_paged_batch, ref_paged_attention
from tests.backend_cuda.test_attention import _mixed


@pytest.mark.parametrize("skip_single", [False, True])
def test_stages_are_handed_over_by_mbarrier_and_tma(skip_single):
    """The producer's TMA copies complete on mbarriers, the consumers wait on them and
    free the stages by arriving (no CTA-wide barrier in the loop), the value MMA stays in flight across the softmax,
    and the three partitions' registers fit the SM's file (setmaxnreg)."""
    kernel = W.compile_sm90(group=4, page=16, skip_single=skip_single)
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive" in ptx
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)) == {"0", "1"}
    # Only the partitions' own named barriers (128 threads) and the region entry's (barrier 1) remain.
    assert not re.search(r"bar\.sync\s+0;", ptx)
    assert "setmaxnreg" in ptx and kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("use_pdl", [True, False])
def test_waits_for_its_producer_only_under_programmatic_dependent_launch(use_pdl):
    """Under PDL the kernel lets the next one launch and waits for the q/k store before any load; without it, no
    grid-dependency instruction at all."""
    ptx = W.compile_sm90(use_pdl=use_pdl).asm["ptx"]
    waits, launches = ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")
    assert (waits, launches) == ((1, 1) if use_pdl else (0, 0))
    if use_pdl:  # the wait comes before the first load of q or the first TMA copy of the cache
        assert ptx.index("griddepcontrol.wait") < min(ptx.index("ld.global"), ptx.index("cp.async.bulk.tensor"))


def test_three_stages_hold_q_in_registers_within_shared_memory():
    kernel = W.compile_sm90(stages=3)
    assert kernel.metadata.shared <= 227 * 1024  # three K and three V tiles of 128 x 128, no Q tile
    assert "cp.async.bulk.tensor.2d" in kernel.asm["ptx"]


def test_refuses_a_stage_count_it_has_no_room_for(monkeypatch):
    monkeypatch.setenv("INFER_CUDA_WS_PREFILL_STAGES", "4")
    try:
        with pytest.raises(ValueError, match="INFER_CUDA_WS_PREFILL_STAGES=4: 2 or 3"):
            importlib.reload(W)
    finally:
        monkeypatch.delenv("INFER_CUDA_WS_PREFILL_STAGES")
        importlib.reload(W)
    assert W.STAGES == 2


def test_serves_only_bf16_fp16_head_dim_128_and_contiguous_pages():
    q = torch.empty((4, 8, 128), dtype=torch.bfloat16)
    cache = torch.empty((2, 16, 2, 128), dtype=torch.bfloat16)
    assert W.operands_fit(q, cache)
    assert W.operands_fit(q.half(), cache.half()) and W.operands_fit(q, torch.empty((2, 32, 2, 128), dtype=q.dtype))
    assert not W.supported(q, cache)  # a CPU tensor: never
    refused = [
        (q.float(), cache.float()),  # fp32 (the CPU-comparison path)
        (q, cache.half()),  # a cache of another dtype
        (torch.empty((4, 8, 64), dtype=q.dtype), torch.empty((2, 16, 2, 64), dtype=q.dtype)),  # head_dim 64
        (q, torch.empty((2, 48, 2, 128), dtype=q.dtype)),  # pages that do not divide the 128-key tile
        (q, torch.empty((2, 2, 16, 2, 128), dtype=q.dtype)[:, 0]),  # pages strided apart (K and V interleaved)
    ]
    assert not any(W.operands_fit(a, b) for a, b in refused)


def test_the_launcher_takes_it_only_for_queries_longer_than_the_threshold(monkeypatch):
    """At most INFER_CUDA_WS_PREFILL_ABOVE (256) query tokens the Triton kernel runs (here interpreted, against the
    reference), above it this kernel (its launch recorded); switched off, never."""
    pb = make_paged_batch([3, 1, 2], [10, 5, 40], 4, 2, 128, 16, torch.float32, "cpu", seed=1)
    launched = []
    monkeypatch.setattr(W, "ENABLED", True)
    monkeypatch.setattr(W, "supported", lambda q, k_cache: True)
    monkeypatch.setattr(W, "launch", lambda *args: launched.append(args[0].shape))
    assert W.ABOVE == 256

    def run(max_query_len: int) -> torch.Tensor:
        return K.paged_attention_prefill(pb.q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens,
                                         pb.block_tables, max_query_len, 0.2, out=poison(torch.empty_like(pb.q)))

    torch.testing.assert_close(run(256).float(), ref_paged_attention(pb, 0.2).float(), **tol(torch.float32))
    assert launched == []
    run(257)
    assert launched == [pb.q.shape]
    monkeypatch.setattr(W, "ENABLED", False)
    run(257)
    assert launched == [pb.q.shape]


def test_refuses_a_threshold_that_is_not_a_token_count(monkeypatch):
    monkeypatch.setenv(W.ABOVE_ENV, "big")
    try:
        with pytest.raises(ValueError, match="INFER_CUDA_WS_PREFILL_ABOVE='big': a query length in tokens"):
            importlib.reload(W)
    finally:
        monkeypatch.delenv(W.ABOVE_ENV)
        importlib.reload(W)
    assert W.ABOVE == 256


@pytest.fixture
def ws_on(monkeypatch):
    """The launcher picks the Gluon kernel at every query length (on by default above 256-token queries;
    INFER_CUDA_WS_PREFILL=0 would turn it off). Yields its module."""
    monkeypatch.setattr(W, "ENABLED", True)
    monkeypatch.setattr(W, "ABOVE", 0)
    return W


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# (q_lens, ctx_lens, Hq, Hkv, head_dim, block_size): head_dim 128, where the kernel serves.
CASES = [
    # GQA 4 (Qwen3-4B): a decode row, extends whose prefixes end mid key tile and mid page, one longer than 128 keys
    ([512, 1, 37, 200], [512, 900, 1037, 1224], 32, 8, 128, 16),
    # one key tile only (n_tiles 1: the prologue and the last value MMA), a context of 0 (padding: zeros)
    ([5, 3, 0, 2], [5, 100, 0, 0], 8, 2, 128, 16),
    # GQA 3: a token's heads straddle 128-row tiles; pages of 32; a prefix of exactly 128 keys (whole key tiles)
    ([129, 50], [257, 50], 6, 2, 128, 32),
    # GQA 1 and 2; a chunk of exactly 128 tokens over a prefix of 256 (the diagonal tile starts a key tile)
    ([128, 1000], [384, 1000], 16, 16, 128, 16),
    ([300, 77], [2348, 77], 16, 8, 128, 16),
]


@gpu
@needs_cuda
@pytest.mark.skipif(not _is_hopper(), reason="the kernel is sm_90's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_reference_and_the_triton_kernel(case, dtype, ws_on):
    q_lens, ctx_lens, hq, hkv, d, bs = case
    pb = make_paged_batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, "cuda", seed=len(q_lens) + hq)
    assert ws_on.supported(pb.q, pb.k_cache)
    scale = d**-0.5
    args = (pb.q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables, pb.max_query_len, scale)
    ws = K.paged_attention_prefill(*args, out=poison(torch.empty_like(pb.q)))
    ref = ref_paged_attention(pb, scale).float()
    torch.testing.assert_close(ws.float().cpu(), ref, **tol(dtype))
    triton_out = K.paged_attention_prefill(*args, out=poison(torch.empty_like(pb.q)), config=A._prefill_config(d, 2))
    # Both sum the same products in fp32 in different tile orders: closer to each other than to the fp32 reference.
    torch.testing.assert_close(ws.float(), triton_out.float(), atol=2e-2, rtol=2e-2)
    for i, c in enumerate(ctx_lens):
        if c == 0 and q_lens[i]:
            start = int(pb.query_start_loc[i])
            assert torch.equal(ws[start : start + q_lens[i]].float().cpu(),
                               torch.zeros_like(ref[start : start + q_lens[i]]))


@gpu
@needs_cuda
@pytest.mark.skipif(not _is_hopper(), reason="the kernel is sm_90's")
@pytest.mark.parametrize("bound_chunks", [False, True])
def test_mixed_step_leaves_the_decode_rows_to_the_decode_kernel(ws_on, bound_chunks):
    """A mixed step at head_dim 128: the one-token sequences' rows stay unwritten (NaN) by this kernel, the
    chunks' tiles are the ones they would be without them, and the decode kernel completes the step; with the
    grid bounded by the three prompt chunks too."""
    _mixed(([40, 1, 70, 1, 1, 33], [45, 90, 200, 17, 3, 100], 32, 8, 128, 16, 2), torch.bfloat16, "cuda",
           bound_chunks=bound_chunks)


@gpu
@needs_cuda
@pytest.mark.skipif(not _is_hopper(), reason="the kernel is sm_90's")
def test_leaves_rows_past_the_batch_unwritten(ws_on):
    pb = make_paged_batch([20, 9], [20, 300], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    q = torch.cat([pb.q, torch.randn_like(pb.q[:7])])  # 7 rows past the last sequence (a padded graph bucket)
    out = poison(torch.empty_like(q))
    K.paged_attention_prefill(q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables,
                              pb.max_query_len, 128**-0.5, out=out)
    assert torch.isnan(out[-7:].float()).all() and not torch.isnan(out[:-7].float()).any()


@gpu
@needs_cuda
@pytest.mark.skipif(not _is_hopper(), reason="the kernel is sm_90's")
def test_graph_replay_equals_eager(ws_on):
    """Captured in a CUDA graph (its TMA descriptors are launch parameters, fixed at capture), a replay over new
    queries in the same buffers writes what an eager launch writes."""
    pb = make_paged_batch([300, 77, 1], [2348, 77, 500], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=5)
    args = (pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables, pb.max_query_len, 128**-0.5)
    out = torch.empty_like(pb.q)
    K.paged_attention_prefill(pb.q, *args, out=out)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.paged_attention_prefill(pb.q, *args, out=out)
    pb.q.copy_(torch.randn_like(pb.q))
    graph.replay()
    eager = K.paged_attention_prefill(pb.q, *args, out=poison(torch.empty_like(pb.q)))
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
