"""Paged attention (prefill/extend varlen and split-KV decode) against a plain-torch causal reference.

Batches have shuffled pages, cached prefix pages (context longer than the new tokens), partially filled
last pages, GQA ratios 1/2/4 and padding rows (context 0). Every cache slot outside a context holds NaN and
the output buffer starts as NaN, so a kernel that reads a stray slot or skips a row fails."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels import attention_decode as D
from infer_backend_cuda.kernels import attention_prefill as A
from infer_backend_cuda.kernels._common import resident_programs
from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
from infer_core.ports.fused_ops import AttentionBatch
from tests.backend_cuda.conftest import gpu, poison, tol
from tests.backend_cuda.reference import make_paged_batch, ref_paged_attention

# (q_lens, ctx_lens, Hq, Hkv, head_dim, block_size)
PREFILL_SMALL = [
    ([5, 1, 9], [5, 12, 20], 4, 2, 32, 4),  # plain prefill, a decode row, an extend over a cached prefix
    ([3, 17], [3, 30], 2, 2, 16, 8),  # GQA 1, query longer than one 16-row tile
    ([16, 2, 1], [16, 40, 0], 4, 1, 32, 16),  # GQA 4, a padding row (context 0 -> zeros)
    ([7, 1, 4], [10, 30, 4], 6, 2, 16, 4),  # GQA 3: a token's heads straddle two packed 16-row tiles
    ([4, 0, 6, 0], [4, 0, 9, 0], 4, 2, 16, 4),  # sequences with no rows (a padded graph batch) between others
]
PREFILL_LARGE = [
    ([512, 1, 37, 200], [512, 900, 1037, 1224], 32, 8, 128, 16),
    ([1000], [1000], 16, 8, 128, 16),
    ([64, 64, 64], [64, 300, 2048], 32, 32, 128, 32),
    ([129, 3], [257, 3], 8, 2, 64, 16),
    ([100, 7], [150, 1200], 16, 4, 256, 16),
    ([77], [77], 14, 2, 64, 16),
]
# Tile shapes other than the interpreter's 16 x 16, with the cases that put the split between the unmasked key
# tiles and the causally masked (diagonal) ones where it is easiest to get wrong. (BLOCK_M, BLOCK_N, warps, stages).
PREFILL_TILED = [
    # 32-row tiles of 16 tokens (GQA 2) over 16-key tiles: a prefix of 13 puts tile 1's unmasked bound
    # (30 keys -> 16) mid-page of 8; after a prefix of 14 each tile's first token sees one key short of a whole
    # key tile (which must stay masked); after 15 it sees exactly whole key tiles, so the masked loop opens on a
    # key tile that row cannot see (its running max comes from the unmasked loop).
    (([40, 33, 20, 1], [53, 47, 35, 70], 4, 2, 16, 8), (32, 16, 4, 1)),
    # 16-row tiles over 32-key tiles: the diagonal region is narrower than one key tile; GQA 4, pages of 4.
    (([21, 9, 0, 30], [50, 9, 0, 95], 8, 2, 16, 4), (16, 32, 4, 1)),
    # The GPU's head_dim-128 shape (128 rows = 32 tokens of GQA 4, 64-key tiles): 100 tokens straddle four
    # row tiles (the last part-full), after prefixes of 80 (mid-page of 16) and 0, with a decode row between.
    (([100, 1, 70], [180, 333, 70], 8, 2, 32, 16), (128, 64, 8, 3)),
    # The same over 128-key tiles (the head_dim-128 default, fastest on the H200): a prefix of 180 ends mid key tile.
    (([100, 1, 70], [180, 333, 70], 8, 2, 32, 16), (128, 128, 8, 2)),
    # GQA 3 (a token's heads straddle row tiles) with 64-row tiles over 32-key tiles, a prefix of 37.
    (([50, 5], [87, 5], 6, 2, 16, 16), (64, 32, 4, 2)),
]
# (ctx_lens, Hq, Hkv, head_dim, block_size, num_splits)
DECODE_SMALL = [
    ([1, 9, 33, 0], 2, 2, 16, 4, 3),
    ([20, 5, 0], 4, 2, 32, 8, 1),
    ([40, 17], 4, 1, 32, 16, 4),
    ([3, 64], 8, 2, 16, 8, None),  # default split choice
]
DECODE_LARGE = [
    ([1, 17, 4000, 0, 513, 2048, 100, 31], 32, 8, 128, 16, None),
    ([8192], 32, 8, 128, 16, None),
    ([8192, 7], 32, 8, 128, 16, 1),
    ([1000] * 64, 16, 8, 128, 16, None),
    ([300, 700, 0, 1], 32, 32, 128, 32, 7),
    ([2000, 9], 16, 4, 256, 16, None),
    ([600, 77], 14, 2, 64, 16, 32),
]

# Mixed steps, split between the two kernels: (q_lens, ctx_lens, Hq, Hkv, head_dim, block_size, num_splits).
MIXED_SMALL = [
    ([1, 1, 9, 4], [13, 6, 9, 21], 4, 2, 32, 4, 3),  # decode rows first, prefixes crossing pages of 4
    ([7, 3, 1, 1], [7, 19, 33, 2], 8, 2, 16, 8, 2),  # decode rows last, GQA 4
    ([1, 5, 1, 0, 12, 1], [9, 14, 40, 0, 12, 1], 6, 2, 16, 4, 4),  # interleaved, GQA 3, an empty sequence
    ([2, 1, 17, 1], [30, 0, 17, 64], 2, 2, 16, 16, None),  # GQA 1, a one-token padding row (context 0)
    ([1, 6, 1, 1], [25, 6, 0, 40], 4, 2, 16, 8, 1),  # one split: pass 1 writes the decode rows, no merge pass
]


def _mixed_batch(case, dtype, device):
    q_lens, ctx_lens, hq, hkv, d, bs, splits = case
    return make_paged_batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, device, seed=len(q_lens) * 5 + d), splits


def _mixed(case, dtype, device, config=None, bound_chunks=False):
    """Each kernel writes exactly its own rows (the other's stay NaN), and together they equal the reference.
    `bound_chunks`: the prefill grid bounded by the batch's prompt chunks (`max_chunk_seqs`)."""
    pb, splits = _mixed_batch(case, dtype, device)
    scale = pb.q.shape[-1] ** -0.5
    single = (pb.query_start_loc[1:] - pb.query_start_loc[:-1]).cpu() == 1
    decode_rows = pb.query_start_loc[:-1].cpu()[single]
    other_rows = torch.ones(pb.q.shape[0], dtype=torch.bool)
    other_rows[decode_rows] = False
    ref = ref_paged_attention(pb, scale).float()

    out = poison(torch.empty_like(pb.q))
    K.paged_attention_prefill(pb.q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables,
                              pb.max_query_len, scale, out=out, config=config, skip_single_token=True,
                              max_chunk_seqs=int((~single & (pb.query_start_loc[1:] > pb.query_start_loc[:-1]).cpu())
                                                 .sum()) if bound_chunks else None)
    assert torch.isnan(out[decode_rows].float()).all()
    torch.testing.assert_close(out[other_rows].float().cpu(), ref[other_rows], **tol(dtype))

    alone = poison(torch.empty_like(pb.q))
    K.paged_attention_decode(pb.q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, scale, out=alone,
                             num_splits=splits, query_start_loc=pb.query_start_loc)
    assert torch.isnan(alone[other_rows].float()).all()
    torch.testing.assert_close(alone[decode_rows].float().cpu(), ref[decode_rows], **tol(dtype))

    K.paged_attention_decode(pb.q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, scale, out=out,
                             num_splits=splits, query_start_loc=pb.query_start_loc)
    torch.testing.assert_close(out.float().cpu(), ref, **tol(dtype))


def _prefill(case, dtype, device, config=None):
    q_lens, ctx_lens, hq, hkv, d, bs = case
    pb = make_paged_batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, device, seed=len(q_lens) + d)
    scale = d**-0.5
    out = poison(torch.empty_like(pb.q))
    y = K.paged_attention_prefill(
        pb.q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables, pb.max_query_len, scale,
        out=out, config=config,
    )
    assert y is out
    torch.testing.assert_close(y.float().cpu(), ref_paged_attention(pb, scale).float(), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_64_bit_cache_offsets(dtype, device, monkeypatch):
    """The 64-bit K/V offsets that a cache view of over 2^31 elements takes, forced on a small cache."""
    from infer_backend_cuda.kernels import attention_prefill

    monkeypatch.setattr(attention_prefill, "OFF32_MAX_ELEMENTS", 0)
    _prefill(PREFILL_TILED[0][0], dtype, device, PREFILL_TILED[0][1])


def test_prefill_refuses_k_and_v_of_different_strides(device):
    pb = make_paged_batch([3], [3], 2, 2, 16, 4, torch.float32, device)
    v_cache = pb.v_cache.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
    with pytest.raises(ValueError, match="strides"):
        K.paged_attention_prefill(pb.q, pb.k_cache, v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables,
                                  pb.max_query_len, 0.25)


def test_prefill_leaves_rows_past_the_batch_unwritten(device):
    """A captured mixed step pads its tokens to a bucket: rows past `query_start_loc[-1]` belong to no sequence
    (and the grid, bounded by the row count, has programs past the batch's last tile); they stay as they were."""
    pb = make_paged_batch([5, 9], [5, 20], 4, 2, 32, 4, torch.float32, device, seed=3)
    q = torch.cat([pb.q, torch.randn(11, 4, 32, device=device)])
    out = poison(torch.empty_like(q))
    K.paged_attention_prefill(q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables,
                              pb.max_query_len, 32**-0.5, out=out)
    torch.testing.assert_close(out[:14].cpu(), ref_paged_attention(pb, 32**-0.5).float(), **tol(torch.float32))
    assert torch.isnan(out[14:]).all()


def _decode(case, dtype, device):
    ctx_lens, hq, hkv, d, bs, splits = case
    pb = make_paged_batch([1] * len(ctx_lens), ctx_lens, hq, hkv, d, bs, dtype, device, seed=len(ctx_lens) * 7 + d)
    scale = d**-0.5
    out = poison(torch.empty_like(pb.q))
    y = K.paged_attention_decode(pb.q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, scale, out=out, num_splits=splits)
    assert y is out
    ref = ref_paged_attention(pb, scale)
    torch.testing.assert_close(y.float().cpu(), ref.float(), **tol(dtype))
    for i, c in enumerate(ctx_lens):
        if c == 0:
            assert torch.equal(y[i].float().cpu(), torch.zeros_like(ref[i].float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_SMALL)
def test_prefill(case, dtype, device):
    _prefill(case, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case,config", PREFILL_TILED)
def test_prefill_tile_shapes(case, config, dtype, device):
    _prefill(case, dtype, device, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_SMALL)
def test_decode(case, dtype, device):
    _decode(case, dtype, device)


@pytest.mark.parametrize("bound_chunks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", MIXED_SMALL)
def test_mixed_split_between_kernels(case, dtype, bound_chunks, device):
    _mixed(case, dtype, device, bound_chunks=bound_chunks)


def test_prefill_grid_bounded_by_prompt_chunks_has_no_program_a_one_token_sequence():
    """With one-token sequences skipped, the grid is the rows' tiles plus one a prompt chunk; one-token sequences
    own no tile. The exact count covers every chunk row; a bound below what the chunks' partial tiles need drops a
    tile (the launch uses the bound)."""
    from infer_backend_cuda.kernels._ragged import grid_tiles

    assert grid_tiles(128 * 4, 128, 128, True, 4) == 8  # a 128-token mixed graph of 128 sequences, 4 chunks
    assert grid_tiles(128 * 4, 128, 128, True, None) == grid_tiles(128 * 4, 128, 128, False, 4) == 132
    assert grid_tiles(64, 128, 3, True, 9) == 4  # never more than the sequences
    case = ([9, 1, 9, 9], [9, 20, 30, 12], 4, 2, 16, 4, 2)  # GQA 2: 18 rows a chunk, two 16-row interpreter tiles
    pb, _ = _mixed_batch(case, torch.float32, "cpu")
    args = (pb.q, pb.k_cache, pb.v_cache, pb.query_start_loc, pb.seq_lens, pb.block_tables, pb.max_query_len, 0.3)
    full = K.paged_attention_prefill(*args, out=poison(torch.empty_like(pb.q)), skip_single_token=True,
                                     max_chunk_seqs=3)
    short = K.paged_attention_prefill(*args, out=poison(torch.empty_like(pb.q)), skip_single_token=True,
                                      max_chunk_seqs=1)
    chunk_rows = torch.ones(pb.q.shape[0], dtype=torch.bool)
    chunk_rows[9] = False
    assert not torch.isnan(full[chunk_rows]).any() and torch.isnan(full[9]).all()
    torch.testing.assert_close(full[chunk_rows], ref_paged_attention(pb, 0.3)[chunk_rows], **tol(torch.float32))
    # 28 tokens x GQA 2 = 56 rows: 4 tiles + 1 for the one chunk bounded, against the chunks' 6 tiles
    written = ~short.isnan()
    assert not written[chunk_rows].all() and torch.equal(short[written], full[written])


def test_mixed_split_with_gpu_tiles(device):
    """The GPU's 128-row prefill tiles (32 tokens of GQA 4): a skipped one-token sequence between two chunks
    that take several tiles each must not shift which tiles the later chunk's programs take."""
    case = ([40, 1, 70, 1, 1, 33], [45, 90, 70, 17, 3, 100], 8, 2, 32, 16, 2)
    _mixed(case, torch.float32, device, config=(128, 64, 8, 3))
    _mixed(case, torch.float32, device, config=(128, 128, 8, 2))


def test_ragged_decode_refuses_a_query_start_loc_of_another_batch(device):
    pb, _ = _mixed_batch(MIXED_SMALL[0], torch.float32, device)
    with pytest.raises(ValueError, match="query_start_loc"):
        K.paged_attention_decode(pb.q, pb.k_cache, pb.v_cache, pb.seq_lens, pb.block_tables, 0.25,
                                 query_start_loc=pb.query_start_loc[:-1])


def test_fp16_prefill_and_decode(device):
    _prefill(PREFILL_SMALL[0], torch.float16, device)
    _decode(DECODE_SMALL[0], torch.float16, device)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", PREFILL_LARGE)
def test_prefill_large(case, dtype, device):
    _prefill(case, dtype, device)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DECODE_LARGE)
def test_decode_large(case, dtype, device):
    _decode(case, dtype, device)


def test_port_dispatch_decode_equals_prefill(device):
    """Through the FusedOps port: a decode batch (is_decode) and the same rows as a ragged batch agree."""
    ctx_lens = [6, 13, 0]
    pb = make_paged_batch([1, 1, 1], ctx_lens, 4, 2, 16, 4, torch.float32, device, seed=11)
    ops = TritonFusedOps(CudaMathOps())

    def batch(is_decode):
        return AttentionBatch(
            positions=(pb.seq_lens.long() - 1).clamp(min=0),
            slot_mapping=torch.full((3,), -1, dtype=torch.int64, device=device),
            query_start_loc=pb.query_start_loc,
            seq_lens=pb.seq_lens,
            block_tables=pb.block_tables,
            max_query_len=1,
            max_seq_len=max(ctx_lens),
            is_decode=is_decode,
            block_size=pb.block_size,
        )

    a = ops.paged_attention(pb.q, pb.k_cache, pb.v_cache, batch(True), 0.25)
    b = ops.paged_attention(pb.q, pb.k_cache, pb.v_cache, batch(False), 0.25)
    torch.testing.assert_close(a, b, **tol(torch.float32))
    torch.testing.assert_close(a.cpu(), ref_paged_attention(pb, 0.25), **tol(torch.float32))


def _port_mixed_batch(pb, tokens: int, device) -> AttentionBatch:  # noqa: ANN001 - a PagedBatch
    """`pb` as a mixed step's batch through the port, over `tokens` token rows (padding rows past its own)."""
    return AttentionBatch(
        positions=torch.zeros(tokens, dtype=torch.int64, device=device),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=pb.query_start_loc,
        seq_lens=pb.seq_lens,
        block_tables=pb.block_tables,
        max_query_len=int((pb.query_start_loc[1:] - pb.query_start_loc[:-1]).max()),
        max_seq_len=int(pb.seq_lens.max()),
        is_decode=False,
        block_size=pb.block_size,
    )


def test_port_mixed_batch_runs_one_token_rows_on_the_decode_kernel(device, monkeypatch):
    """Through the FusedOps port: a mixed batch padded like a captured graph (an empty sequence, token rows past
    the batch) equals the reference, with its one-token sequences handed to the decode kernel by row."""
    pb = make_paged_batch([1, 6, 1, 0, 1], [9, 11, 26, 0, 1], 4, 2, 16, 4, torch.float32, device, seed=5)
    q = torch.cat([pb.q, torch.randn(3, 4, 16, device=device)])  # 3 padding token rows
    batch = _port_mixed_batch(pb, q.shape[0], device)
    calls = []
    decode = K.paged_attention_decode

    def spy(*args, **kwargs):
        calls.append(kwargs.get("query_start_loc"))
        return decode(*args, **kwargs)

    monkeypatch.setattr(K, "paged_attention_decode", spy)
    y = TritonFusedOps(CudaMathOps()).paged_attention(q, pb.k_cache, pb.v_cache, batch, 0.25)
    assert len(calls) == 1 and calls[0] is pb.query_start_loc
    torch.testing.assert_close(y[: pb.q.shape[0]].cpu(), ref_paged_attention(pb, 0.25), **tol(torch.float32))


HOPPER_SHARED_MEMORY = 228 * 1024


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_prefill_tiles_fit_shared_memory(monkeypatch, head_dim: int, element_size: int) -> None:  # noqa: ANN001
    """The GPU default tiles' pipelined K and V stages plus the query tile fit in an H200 SM's shared memory for
    every dtype: fp32 at 128 x 128 tiles of 2 stages did not, and the H200 refused the launch."""
    monkeypatch.setattr(A, "interpreting", lambda: False)
    bm, bn, _warps, stages = A._prefill_config(head_dim, element_size)
    staged = (2 * stages * bn + bm) * head_dim * element_size
    assert staged <= HOPPER_SHARED_MEMORY, (bm, bn, stages)


@pytest.mark.parametrize(("raw", "expected"), [("", None), ("32:4:2", (32, 4, 2)), (" 128:8:3 ", (128, 8, 3))])
def test_decode_tile_override_parses(monkeypatch, raw: str, expected) -> None:  # noqa: ANN001
    monkeypatch.setenv(D.TILE_ENV, raw)
    assert D._tile_override() == expected


@pytest.mark.parametrize("raw", ["32:4", "a:b:c", "48:4:2", "32:3:2", "32:4:0", "8:4:2"])
def test_decode_tile_override_rejects_bad_values(monkeypatch, raw: str) -> None:  # noqa: ANN001
    monkeypatch.setenv(D.TILE_ENV, raw)
    with pytest.raises(ValueError, match=D.TILE_ENV):
        D._tile_override()


def test_decode_tile_override_sets_the_gpu_config_at_head_dim_128_only(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(D, "interpreting", lambda: False)
    assert D._decode_config(128, 8) == (64, 4, 2)
    monkeypatch.setattr(D, "TILE", (32, 2, 2))
    assert D._decode_config(128, 8) == (32, 2, 2)
    assert D._decode_config(128, 1) == (32, 2, 2)  # the override holds at every batch
    assert D._decode_config(64, 8) == (32, 2, 2)
    assert D._decode_config(256, 8) == (32, 4, 2)  # a 256-dim head keeps its own tile


def test_decode_tile_is_32_keys_up_to_two_sequences(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(D, "interpreting", lambda: False)
    assert [D._decode_config(128, n)[0] for n in (1, 2, 3, 4, 64)] == [32, 32, 64, 64, 64]
    assert D._decode_config(256, 1) == (32, 4, 2)


H200 = dict(regs_per_sm=65536, shared_per_sm=233472, threads_per_sm=2048)


@pytest.mark.parametrize(("n_regs", "warps", "shared", "programs"), [
    (128, 4, 38912, 4),  # the split pass's 64:4:2, fused rope form (ptxas on the H200, sixteenth session)
    (166, 2, 21504, 6),  # the narrow 32:2:2: 5,376 registers a warp -> 12 warps
    (96, 4, 21504, 5),  # 32:4:2
    (80, 8, 38912, 3),  # 64:8:2: 25 warps' registers hold three programs of 8 warps
    (152, 4, 38912, 3),  # 4,864 registers a warp -> 13 warps -> 3 programs
    (32, 4, 0, 16),  # the thread limit: 2,048 threads
    (16, 1, 0, 32),  # the program limit
    (32, 4, 120000, 1),  # shared memory
])
def test_resident_programs_takes_the_tightest_resource(n_regs, warps, shared, programs) -> None:  # noqa: ANN001
    assert resident_programs(n_regs, warps, shared, **H200) == programs



@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_attention_on_two_streams_equals_one_stream(monkeypatch):
    """A chat-shaped mixed step (Qwen3-4B heads: a 40-token chunk beside 24 decodes at scattered contexts) with the
    prefill attention forked to a side stream: eagerly and as a replayed CUDA graph, every row equals the one-stream
    run bit for bit (the kernels write disjoint rows), and the reference."""
    import infer_backend_cuda.ops as O

    q_lens = [1] * 24 + [40]
    ctx = [50 + 37 * i for i in range(24)] + [230]
    pb = make_paged_batch(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=21)
    batch = _port_mixed_batch(pb, pb.q.shape[0], "cuda")
    ops = TritonFusedOps(CudaMathOps())
    monkeypatch.setattr(O, "MIXED_STREAMS", False)
    one = ops.paged_attention(pb.q, pb.k_cache, pb.v_cache, batch, 128**-0.5)
    monkeypatch.setattr(O, "MIXED_STREAMS", True)
    two = ops.paged_attention(pb.q, pb.k_cache, pb.v_cache, batch, 128**-0.5)
    torch.cuda.synchronize()
    assert torch.equal(one, two)
    torch.testing.assert_close(two.float().cpu(), ref_paged_attention(pb, 128**-0.5).float(), **tol(torch.bfloat16))

    static_out = torch.empty_like(one)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as the backend's capture_graph does
        static_out.copy_(ops.paged_attention(pb.q, pb.k_cache, pb.v_cache, batch, 128**-0.5))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(ops.paged_attention(pb.q, pb.k_cache, pb.v_cache, batch, 128**-0.5))
    poison(static_out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, one)


def test_mixed_attention_streams_leave_cpu_tensors_on_one_path(monkeypatch):
    """The side stream is a CUDA one: with the switch on, a mixed batch of CPU tensors (the interpreted kernels)
    still runs both kernels in order and equals the reference."""
    import infer_backend_cuda.ops as O

    if torch.cuda.is_available():
        pytest.skip("the interpreted kernels run on CPU tensors only without a GPU")
    monkeypatch.setattr(O, "MIXED_STREAMS", True)
    pb = make_paged_batch([1, 6, 1], [9, 11, 26], 4, 2, 16, 4, torch.float32, "cpu", seed=7)
    y = TritonFusedOps(CudaMathOps()).paged_attention(pb.q, pb.k_cache, pb.v_cache,
                                                      _port_mixed_batch(pb, pb.q.shape[0], "cpu"), 0.25)
    torch.testing.assert_close(y, ref_paged_attention(pb, 0.25), **tol(torch.float32))
