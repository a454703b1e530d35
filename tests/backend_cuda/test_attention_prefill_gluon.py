"""The Gluon prefill attentions (kernels/attention_prefill_gluon.py, and the warp-specialised
kernels/attention_prefill_ws.py): compiled for sm_90 without a GPU (Gluon kernels do not run under the interpreter),
their value MMA kept in flight across the softmax; on the GPU, each against the plain torch reference and the Triton
kernel, over the shapes where its masks and stages are easiest to get wrong."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels import attention_prefill as A
from infer_backend_cuda.kernels import attention_prefill_gluon as G
from infer_backend_cuda.kernels import attention_prefill_ws as W
from tests.backend_cuda.conftest import gpu, needs_cuda, poison, tol
from tests.backend_cuda.reference import make_paged_batch, ref_paged_attention
from tests.backend_cuda.test_attention import _mixed


@pytest.mark.parametrize("skip_single", [False, True])
def test_the_value_mma_runs_under_the_softmax(skip_single):
    """The loop waits for the scores with the value MMA still in flight (`wgmma.wait_group 1`), which Triton's own
    pipeliner never emits for attention (it waits for 0 before the softmax reads the scores)."""
    kernel = G.compile_sm90(group=4, page=16, skip_single=skip_single)
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", kernel.asm["ptx"]))
    assert waits == {"0", "1"}
    assert "cp.async" in kernel.asm["ptx"]  # the pages are gathered asynchronously
    assert kernel.metadata.shared <= 227 * 1024  # Q, two K and two V tiles of 128 x 128 in one SM's shared memory


@pytest.mark.parametrize("block_n,stages", [(128, 3), (64, 4)])
def test_the_a_b_tiles_fit_shared_memory(block_n, stages):
    """The key tiles and stage counts the switches allow at their largest (the refusal below covers the rest)."""
    kernel = G.compile_sm90(block_n=block_n, stages=stages)
    assert kernel.metadata.shared <= 227 * 1024
    # The loop's wait leaves stages - 2 copy groups in flight: a tile's copies get stages - 1 iterations to land.
    assert str(stages - 2) in re.findall(r"cp\.async\.wait_group\s+(\d+);", kernel.asm["ptx"])


def test_refuses_a_tile_that_does_not_fit_shared_memory(monkeypatch):
    monkeypatch.setenv("INFER_CUDA_GLUON_PREFILL_STAGES", "4")  # 4 x 2 x 32 KB of K / V tiles at 128 keys
    try:
        with pytest.raises(ValueError, match="keys 128 take 2-3 stages"):
            importlib.reload(G)
    finally:
        monkeypatch.delenv("INFER_CUDA_GLUON_PREFILL_STAGES")
        importlib.reload(G)
    assert (G.BLOCK_N, G.STAGES) == (128, 2)


def test_serves_only_hopper_bf16_fp16_head_dim_128():
    q = torch.empty((4, 8, 128), dtype=torch.bfloat16)  # a CPU tensor: never
    assert not G.supported(q, torch.empty((2, 16, 2, 128), dtype=torch.bfloat16))


def test_ws_kernel_hands_stages_over_by_mbarrier_and_tma():
    """The warp-specialised kernel: the producer's TMA copies complete on mbarriers, the consumers wait on them and
    free the stages by arriving (no CTA-wide barrier in the loop), the value MMA stays in flight across the softmax,
    and the three partitions' registers fit the SM's file (setmaxnreg)."""
    kernel = W.compile_sm90(group=4, page=16, skip_single=True)
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive" in ptx
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)) == {"0", "1"}
    # Only the partitions' own named barriers (128 threads) and the region entry's (barrier 1) remain.
    assert not re.search(r"bar\.sync\s+0;", ptx)
    assert "setmaxnreg" in ptx and kernel.metadata.shared <= 227 * 1024


def test_ws_kernel_three_stages_hold_q_in_registers_within_shared_memory():
    kernel = W.compile_sm90(stages=3)
    assert kernel.metadata.shared <= 227 * 1024  # three K and three V tiles of 128 x 128, no Q tile
    assert "cp.async.bulk.tensor.2d" in kernel.asm["ptx"]


def test_ws_kernel_refuses_a_stage_count_it_has_no_room_for(monkeypatch):
    monkeypatch.setenv("INFER_CUDA_WS_PREFILL_STAGES", "4")
    try:
        with pytest.raises(ValueError, match="INFER_CUDA_WS_PREFILL_STAGES=4: 2 or 3"):
            importlib.reload(W)
    finally:
        monkeypatch.delenv("INFER_CUDA_WS_PREFILL_STAGES")
        importlib.reload(W)
    assert W.STAGES == 2


def test_ws_kernel_serves_only_contiguous_pages_on_hopper():
    q = torch.empty((4, 8, 128), dtype=torch.bfloat16)  # a CPU tensor: never
    assert not W.supported(q, torch.empty((2, 16, 2, 128), dtype=torch.bfloat16))


@pytest.fixture(params=["gluon", "ws"])
def gluon_on(request, monkeypatch):
    """The launcher picks one of the Gluon kernels (INFER_CUDA_GLUON_PREFILL=1 / INFER_CUDA_WS_PREFILL=1; both off
    by default). Yields its module."""
    module = {"gluon": G, "ws": W}[request.param]
    monkeypatch.setattr(module, "ENABLED", True)
    return module


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# (q_lens, ctx_lens, Hq, Hkv, head_dim, block_size): head_dim 128, where the Gluon kernel serves.
GLUON_CASES = [
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
@pytest.mark.skipif(not _is_hopper(), reason="the Gluon kernel is sm_90's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GLUON_CASES)
def test_matches_the_reference_and_the_triton_kernel(case, dtype, gluon_on):
    q_lens, ctx_lens, hq, hkv, d, bs = case
    pb = make_paged_batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, "cuda", seed=len(q_lens) + hq)
    assert gluon_on.supported(pb.q, pb.k_cache)
    scale = d**-0.5
    args = (pb.q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables, pb.max_query_len, scale)
    gluon = K.paged_attention_prefill(*args, out=poison(torch.empty_like(pb.q)))
    ref = ref_paged_attention(pb, scale).float()
    torch.testing.assert_close(gluon.float().cpu(), ref, **tol(dtype))
    triton_out = K.paged_attention_prefill(*args, out=poison(torch.empty_like(pb.q)), config=A._prefill_config(d, 2))
    # Both sum the same products in fp32 in different tile orders: closer to each other than to the fp32 reference.
    torch.testing.assert_close(gluon.float(), triton_out.float(), atol=2e-2, rtol=2e-2)
    for i, c in enumerate(ctx_lens):
        if c == 0 and q_lens[i]:
            start = int(pb.query_start_loc[i])
            assert torch.equal(gluon[start : start + q_lens[i]].float().cpu(),
                               torch.zeros_like(ref[start : start + q_lens[i]]))


@gpu
@needs_cuda
@pytest.mark.skipif(not _is_hopper(), reason="the Gluon kernel is sm_90's")
def test_mixed_step_leaves_the_decode_rows_to_the_decode_kernel(gluon_on):
    """A mixed step at head_dim 128: the one-token sequences' rows stay unwritten (NaN) by the Gluon kernel, the
    chunks' tiles are the ones they would be without them, and the decode kernel completes the step."""
    _mixed(([40, 1, 70, 1, 1, 33], [45, 90, 200, 17, 3, 100], 32, 8, 128, 16, 2), torch.bfloat16, "cuda")


@gpu
@needs_cuda
@pytest.mark.skipif(not _is_hopper(), reason="the Gluon kernel is sm_90's")
def test_leaves_rows_past_the_batch_unwritten(gluon_on):
    pb = make_paged_batch([20, 9], [20, 300], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    q = torch.cat([pb.q, torch.randn_like(pb.q[:7])])  # 7 rows past the last sequence (a padded graph bucket)
    out = poison(torch.empty_like(q))
    K.paged_attention_prefill(q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables,
                              pb.max_query_len, 128**-0.5, out=out)
    assert torch.isnan(out[-7:].float()).all() and not torch.isnan(out[:-7].float()).any()
