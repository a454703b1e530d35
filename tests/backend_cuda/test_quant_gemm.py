"""The W4A16 (AWQ) and W8A8 (block FP8) kernels against the CPU reference numerics (`infer_backend_cpu.quant_math`,
itself checked against an independent packer and transformers in tests/worker/test_quantized_models.py).
Interpreter shapes are tiny; the Qwen3-4B shapes, odd row counts and CUDA-graph replay are marked `gpu`."""

from __future__ import annotations

import json

import pytest
import torch

from infer_backend_cpu.quant_math import awq_dequantize, fp8_block_linear as ref_fp8_linear, quantize_activation_fp8
from infer_backend_cuda.kernels import awq_gemm as A, fp8_gemm as F8
from tests.backend_cuda.conftest import LaunchSpy, gpu, needs_cuda, poison, tol
from tests.backend_cuda.quant_operands import QWEN3_4B, activations, awq_operands, fp8_operands


def _awq_reference(x, qweight, qzeros, scales, bias=None):
    w = awq_dequantize(qweight.cpu(), qzeros.cpu(), scales.cpu()).to(x.dtype).float()
    y = x.cpu().float() @ w
    return y + bias.cpu().float() if bias is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,config", [(1, None), (3, A.AwqConfig(4, 16, 32, 2, 1)), (5, None),
                                      (3, A.AwqConfig(16, 16, 32, 4, 1)), (19, A.AwqConfig(16, 32, 16, 4, 1))])
def test_awq_linear_matches_the_dequantized_reference(m, config, dtype, device):
    qweight, qzeros, scales = awq_operands(40, 64, 32, device)  # N = 40: a partial column tile
    bias = activations(40, 1, torch.float32, device, 7).reshape(40).to(dtype)
    x = activations(m, 64, dtype, device)
    out = poison(torch.empty((m, 40), dtype=dtype, device=device))
    y = A.awq_linear(x, qweight, qzeros, scales, bias, out=out, config=config)
    assert y is out
    torch.testing.assert_close(y.float().cpu(), _awq_reference(x, qweight, qzeros, scales, bias), **tol(dtype))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,config", [(1, None), (3, A.AwqConfig(4, 16, 16, 2, 1, 3)), (7, None),
                                      (9, A.AwqConfig(16, 16, 32, 4, 1, 2)), (17, None)])
def test_awq_group_sizes_odd_rows_and_partial_column_tiles(group, m, config, device):
    """N = 72: no power-of-two column tile of 16 or more divides it (the last tile is one word); K = 256 is two to eight
    groups; the row counts leave partial row tiles on both product paths, with and without split-K."""
    qweight, qzeros, scales = awq_operands(72, 256, group, device, seed=group)
    x = activations(m, 256, torch.float32, device)
    out = poison(torch.empty((m, 72), dtype=torch.float32, device=device))
    y = A.awq_linear(x, qweight, qzeros, scales, out=out, config=config)
    torch.testing.assert_close(y.cpu(), _awq_reference(x, qweight, qzeros, scales), **tol(torch.float32))


@pytest.mark.parametrize("m,split", [(1, 3), (3, 4), (2, 64)])
def test_awq_split_k_sums_every_range_once(m, split, device):
    """K = 96 in groups of 32 with 16-row steps: split 3 gives three whole groups, split 4 ranges of 32, and a
    request beyond K / block_k is cut to one step per range; each adds the bias once."""
    qweight, qzeros, scales = awq_operands(40, 96, 32, device)
    bias = activations(40, 1, torch.float32, device, 7).reshape(40)
    x = activations(m, 96, torch.float32, device)
    out = poison(torch.empty((m, 40), dtype=torch.float32, device=device))
    y = A.awq_linear(x, qweight, qzeros, scales, bias, out=out, config=A.AwqConfig(4, 16, 16, 2, 1, split))
    torch.testing.assert_close(y.cpu(), _awq_reference(x, qweight, qzeros, scales, bias), **tol(torch.float32))


def test_awq_split_k_last_range_stops_at_k(device):
    """K = 160 in groups of 32 with 16-row steps: 10 steps in ranges of 3, so the last range would run two steps
    past K. The scale rows after the last group are NaN here (memory past the tensor, as on the H200, where
    reading it gave NaN partials and then an illegal address): a kernel that reads them cannot match."""
    qweight, qzeros, scales = awq_operands(40, 160, 32, device)
    padded = torch.cat([scales, torch.full_like(scales[:1], float("nan"))])
    x = activations(1, 160, torch.float32, device)
    out = poison(torch.empty((1, 40), dtype=torch.float32, device=device))
    y = A.awq_linear(x, qweight, qzeros, padded[:5], out=out, config=A.AwqConfig(1, 16, 16, 2, 1, 4))
    torch.testing.assert_close(y.cpu(), _awq_reference(x, qweight, qzeros, scales), **tol(torch.float32))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_awq_gemv_rows_groups_and_split_k(m, splits, group, device):
    """The CUDA-core GEMV (block_m <= 8): N = 40 is five words, so a 16-column program ends in a half-masked one
    and a 256-column one masks most of its words; K is three groups, one range each when split. The GEMV
    multiplies the exact dequantized weights (no rounding to x's dtype): in fp32 it is the reference."""
    qweight, qzeros, scales = awq_operands(40, 3 * group, group, device, seed=group + m)
    bias = activations(40, 1, torch.float32, device, 7).reshape(40)
    x = activations(m, 3 * group, torch.float32, device)
    for block_n in (16, 256):
        out = poison(torch.empty((m, 40), dtype=torch.float32, device=device))
        cfg = A.AwqConfig(A.next_pow2(m), block_n, A.group_block_k(group, 16), 2, 1, splits)
        y = A.awq_linear(x, qweight, qzeros, scales, bias, out=out, config=cfg)
        torch.testing.assert_close(y.cpu(), _awq_reference(x, qweight, qzeros, scales, bias), **tol(torch.float32))


@pytest.mark.parametrize("m,cfg", [(1, A.AwqConfig(1, 32, 16, 2, 1, 2)), (4, A.AwqConfig(4, 32, 16, 2, 1, 2)),
                                   (4, A.AwqConfig(16, 32, 16, 4, 1, 3)), (19, A.AwqConfig(32, 16, 32, 4, 1, 2))])
def test_awq_decode_kernels_multiply_the_exact_dequantized_weights(m, cfg, device):
    """bf16 activations: the reference rounds each dequantized weight to bf16 (2^-9 relative); the GEMV and the
    decode tiles (SCALE_AFTER: the integers q - z, then the scales) do not. A bf16 output matches the reference
    within the bf16 tolerance; an fp32 output (no final rounding) is the exact fp32 product of x and the
    dequantized weights, which the rounded reference is not."""
    qweight, qzeros, scales = awq_operands(72, 256, 64, device, seed=3)
    x = activations(m, 256, torch.bfloat16, device)
    y = A.awq_linear(x, qweight, qzeros, scales, config=cfg).float().cpu()
    ref = _awq_reference(x, qweight, qzeros, scales)
    torch.testing.assert_close(y, ref, **tol(torch.bfloat16))
    wide = A.awq_linear(x, qweight, qzeros, scales, out=torch.empty((m, 72), device=device), config=cfg).cpu()
    exact = x.cpu().float() @ awq_dequantize(qweight.cpu(), qzeros.cpu(), scales.cpu()).float()
    torch.testing.assert_close(wide, exact, **tol(torch.float32))
    assert (ref - exact).abs().max() > 10 * (wide - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_awq_prefill_tiles_match_the_reference(dtype, device):
    """Row tiles past SCALE_AFTER_MAX_M scale the weight before the product (rounded to x's dtype, as the
    reference's dequantized GEMM does); 40 rows leave a partial 64-row tile, K = 256 four groups of 64."""
    qweight, qzeros, scales = awq_operands(72, 256, 64, device, seed=3)
    x = activations(40, 256, dtype, device)
    cfg = A.AwqConfig(64, 32, 16, 4, 1, 2)
    assert cfg.block_m > A.SCALE_AFTER_MAX_M
    y = A.awq_linear(x, qweight, qzeros, scales, out=torch.empty((40, 72), device=device), config=cfg).cpu()
    torch.testing.assert_close(y, _awq_reference(x, qweight, qzeros, scales), **tol(dtype))


def test_awq_decode_configs_pick_the_gemv_and_fill_the_gpu():
    """Qwen3-4B at batch 1: o_proj (N = 2560, K = 4096) is 10 GEMV column blocks, so K is cut (whole groups) until
    the launch has hundreds of programs; gate_up (N = 19456) needs little splitting; the workspace stays within
    half the weight bytes. From 2 rows the decode tiles (whole-group K steps, the integer products; measured faster
    than the row programs at 2 rows and than the GEMV at 4)."""
    narrow, wide = A.default_config(1, 2560, 4096, 128), A.default_config(1, 19456, 2560, 128)
    assert narrow.block_m <= A.SKINNY_MAX_M and wide.block_m <= A.SKINNY_MAX_M
    assert narrow.k_splits * -(-2560 // narrow.block_n) >= 256 and narrow.k_splits <= 4096 // 128
    assert wide.k_splits < narrow.k_splits
    assert not A.default_config(1, 6144, 2560, 128).row_programs
    assert all(A.default_config(m, 6144, 2560, 128).block_m == A.DECODE_TILE_M for m in (2, 3, 4, 5, 8, 16))
    two = A.default_config(2, 6144, 2560, 128)
    assert two.block_k == 128 and A.SCALE_AFTER_MAX_M >= two.block_m  # whole-group steps, the integer products


def test_awq_tuned_table_serves_its_row_buckets(tmp_path, monkeypatch):
    """A GPU's table entry of the 16-row bucket serves 2 to 16 rows of its shape and group (not another shape, group
    or GPU, not the CPU), the 32-row bucket's 17 to 32 (not 33: no entry); one row takes the one-row bucket's entry
    where there is one; with the GEMV switched on for 2 rows (A/B runs) 2 rows keep it."""
    tile, one = A.AwqConfig(16, 64, 128, 4, 3, 25), A.AwqConfig(16, 128, 128, 8, 3, 5)
    wide = A.AwqConfig(32, 128, 64, 4, 3, 8)
    table = tmp_path / "awq_gemm.json"
    table.write_text(json.dumps({"GPU X": [dict(m=16, n=2560, k=4096, group=128, config=list(tile)),
                                           dict(m=1, n=2560, k=4096, group=128, config=list(one)),
                                           dict(m=32, n=2560, k=4096, group=128, config=list(wide))]}))
    monkeypatch.setattr(A, "_TABLE", table)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    A._tuned_table.cache_clear()
    try:
        cuda = torch.device("cuda")
        assert all(A.choose_config(m, 2560, 4096, 128, cuda) == tile for m in (2, 3, 16))
        assert A.choose_config(1, 2560, 4096, 128, cuda) == one
        assert all(A.choose_config(m, 2560, 4096, 128, cuda) == wide for m in (17, 24, 32))
        for args in ((33, 2560, 4096, 128), (4, 2560, 9728, 128), (4, 2560, 4096, 64)):
            assert A.choose_config(*args, cuda) == A.default_config(*args)
        assert A.choose_config(4, 2560, 4096, 128, torch.device("cpu")) == A.default_config(4, 2560, 4096, 128)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU Y")
        assert A.choose_config(4, 2560, 4096, 128, cuda) == A.default_config(4, 2560, 4096, 128)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
        monkeypatch.setattr(A, "GEMV_MAX_M", 2)
        assert A.choose_config(2, 2560, 4096, 128, cuda) == A.default_config(2, 2560, 4096, 128)
        assert A.choose_config(2, 2560, 4096, 128, cuda).block_m <= A.SKINNY_MAX_M
    finally:
        A._tuned_table.cache_clear()


def test_fp8_tuned_table_serves_its_row_buckets(tmp_path, monkeypatch):
    """An entry of bucket 64 serves 33 to 64 rows of its shape and group only (not 32 or 65, not another shape,
    group or GPU, not the CPU), where the default rules take over (None)."""
    tile = F8.Fp8Config(64, 64, 4, 4, 2)
    table = tmp_path / "fp8_gemm.json"
    table.write_text(json.dumps({"GPU X": [dict(m=64, n=6144, k=2560, group=128, config=list(tile))]}))
    monkeypatch.setattr(F8, "_TABLE", table)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    F8._tuned_table.cache_clear()
    try:
        cuda = torch.device("cuda")
        assert all(F8.choose_config(m, 6144, 2560, 128, cuda) == tile for m in (33, 40, 64))
        for args in ((32, 6144, 2560, 128), (65, 6144, 2560, 128), (64, 2560, 4096, 128), (64, 6144, 2560, 64)):
            assert F8.choose_config(*args, cuda) is None
        assert F8.choose_config(64, 6144, 2560, 128, torch.device("cpu")) is None
        assert F8.choose_config(2 * F8.TABLE_MAX_M, 6144, 2560, 128, cuda) is None
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU Y")
        assert F8.choose_config(64, 6144, 2560, 128, cuda) is None
    finally:
        F8._tuned_table.cache_clear()


def test_fp8_block_linear_takes_the_table_entry(monkeypatch, device):
    """With no config given the GEMM launches the table's entry (a row-streaming entry too narrow for the rows
    is refused by its own check, so it was taken), and a cuBLASLt entry where cuBLASLt cannot take the operands
    (partial scale blocks, no Hopper) falls back to the default rules' result."""
    codes, scale_inv, scale_row = fp8_operands([40, 24], 200, (16, 64), device)
    x = activations(3, 200, torch.float32, device)
    expected = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, config=F8.default_config(3, 64, 200, 64))
    monkeypatch.setattr(F8, "choose_config", lambda *args: F8.Fp8Config(2, 8, 2, 1, 1, 2))
    with pytest.raises(ValueError, match="row-streaming"):
        F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64)
    monkeypatch.setattr(F8, "choose_config", lambda *args: F8.Fp8Config(0, 0, 0, 0, scaled_mm=True))
    assert torch.equal(F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64), expected)


def test_tuned_table_merge_replaces_only_its_keys(tmp_path):
    """The bench scripts' writer: this GPU's entries of the new keys replaced, its other entries and other GPUs'
    kept, the result sorted by key and read back by `entries`."""
    from infer_backend_cuda.kernels import tuned_table

    path = tmp_path / "t.json"
    old = [dict(m=64, n=1, k=2, group=128, config=[1], us=9.0), dict(m=16, n=1, k=2, group=128, config=[2], us=5.0)]
    path.write_text(json.dumps({"GPU X": old, "GPU Y": [dict(m=64, n=1, k=2, group=128, config=[3], us=1.0)]}))
    new = [dict(m=64, n=1, k=2, group=128, config=[4], us=7.0), dict(m=32, n=1, k=2, group=128, config=[5], us=6.0)]
    tuned_table.merge(path, "GPU X", new, F8.table_key)
    assert [e["config"] for e in tuned_table.entries(path, "GPU X")] == [[2], [5], [4]]
    assert [e["config"] for e in tuned_table.entries(path, "GPU Y")] == [[3]]
    assert tuned_table.entries(path, "GPU Z") == [] and tuned_table.entries(tmp_path / "none.json", "GPU X") == []


def test_committed_fp8_table_holds_launchable_configs():
    """Every committed entry is cuBLASLt's or a Triton tile the kernels launch: tensor-core tiles of >= 16 rows
    (or the CUDA-core rows of a skinny bucket), whole K ranges, a row-streaming config covering its bucket."""
    entries = [e for rows in json.loads(F8._TABLE.read_text()).values() for e in rows]
    assert entries
    for e in entries:
        cfg = F8.Fp8Config(*e["config"])
        assert e["m"] == F8.table_rows(e["m"]) and e["group"] == 128, e
        if cfg.scaled_mm:
            continue
        assert cfg.block_n & (cfg.block_n - 1) == 0 and 1 <= cfg.k_splits <= -(-e["k"] // e["group"]), e
        assert cfg.block_m >= 16 or e["m"] <= F8.SKINNY_MAX_M, e
        assert not cfg.row_groups or cfg.block_m >= e["m"], e


def test_committed_awq_table_holds_launchable_configs():
    """Every committed entry fits the kernels' rules for its shape: K steps inside a group, whole packed words,
    a row tile covering its bucket, at most as many K ranges as steps."""
    entries = [e for rows in json.loads(A._TABLE.read_text()).values() for e in rows]
    assert entries
    for e in entries:
        cfg = A.AwqConfig(*e["config"])
        assert e["group"] % cfg.block_k == 0 and cfg.block_n % 8 == 0 and cfg.block_m >= e["m"], e
        assert 1 <= cfg.k_splits <= e["k"] // cfg.block_k and e["m"] == A.table_rows(e["m"]), e


def test_awq_tiled_configs_fill_the_gpu_at_decode_batches():
    """From 5 to 64 rows the tiled kernel, bound by the SMs that dequantize: Qwen3-4B's narrow GEMMs (qkv, o_proj,
    down) split K until the launch covers the H200's 132 SMs, with the fp32 workspace within the int4 weight's
    bytes (16 M splits / K <= 1)."""
    for m in (8, 16, 32):
        for n, k in ((6144, 2560), (2560, 4096), (2560, 9728)):
            cfg = A.default_config(m, n, k, 128)
            assert cfg.block_m > A.SKINNY_MAX_M
            splits = A.split_k.steps_per_split(k // cfg.block_k, cfg.k_splits)[1]
            programs = -(-m // cfg.block_m) * -(-n // cfg.block_n) * splits
            assert programs >= 132, (m, n, k, cfg)
            assert 16 * m * splits <= k, (m, n, k, cfg)


def test_awq_refuses_groups_the_kernels_cannot_step(device):
    assert A.group_block_k(128, 64) == 64 and A.group_block_k(96, 64) == 32 and A.group_block_k(32, 64) == 32
    with pytest.raises(ValueError, match="divisible by 16"):
        A.check_group(8)
    qweight, qzeros, scales = awq_operands(40, 96, 32, device)
    with pytest.raises(ValueError, match="whole number of groups"):  # K = 100: 3 groups of 33 do not tile it
        A.awq_linear(activations(1, 100, torch.float32, device), torch.cat([qweight, qweight[:4]]), qzeros, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,group", [(64, 64), (200, 64),  # 200 = 3 groups of 64 and a partial one of 8
                                     (2245, 32)])  # 71 groups of 32, the last partial
def test_fp8_activation_quant_equals_the_reference_bit_for_bit(k, group, dtype, device):
    x = activations(5, k, dtype, device) * 3
    x[2] = 0  # amax = 0: scale 1, codes 0
    x[3, group:2 * group] *= 1e3  # one group far above its row's others: scales are per group
    codes, scales = F8.fp8_quantize_activation(x, group)
    ref_codes, ref_scales = quantize_activation_fp8(x.cpu(), group)
    assert torch.equal(scales.cpu(), ref_scales)
    assert torch.equal(codes.cpu().view(torch.uint8), ref_codes.contiguous().view(torch.uint8))


@pytest.mark.parametrize("block_m", [4, 16])  # CUDA-core products (quantizing x itself), tensor-core tiles
@pytest.mark.parametrize("m,splits", [(1, 2), (3, 4), (2, 9)])
def test_fp8_split_k_sums_every_group_once(m, splits, block_m, device):
    """K = 200 in groups of 64 (the last partial): 2 ranges of 2 groups, 4 of one, and a request beyond the group
    count cut to one group a range; the bias is added once."""
    codes, scale_inv, scale_row = fp8_operands([40, 24], 200, (16, 64), device)
    bias = activations(64, 1, torch.float32, device, 7).reshape(64)
    x = activations(m, 200, torch.float32, device)
    out = poison(torch.empty((m, 64), dtype=torch.float32, device=device))
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, bias, out=out,
                            config=F8.Fp8Config(block_m, 16, 4, 1, splits))
    ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 64, bias.cpu())
    torch.testing.assert_close(y.cpu(), ref.float(), **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,config", [(1, None), (5, None), (3, F8.Fp8Config(4, 8, 2, 1)),
                                      (19, F8.Fp8Config(16, 16, 4, 1)), (2, F8.Fp8Config(16, 32, 4, 1)),
                                      # the row-streaming kernel: 1, 2 and 4 groups a step, a partial row tile
                                      (1, F8.Fp8Config(1, 16, 4, 1, 1, 1)), (3, F8.Fp8Config(4, 8, 2, 1, 1, 2)),
                                      (2, F8.Fp8Config(2, 128, 4, 1, 1, 4))])
def test_fp8_block_linear_matches_the_w8a8_reference(m, config, dtype, device):
    # Parts 40 and 24 with blocks of 16 rows: part one ends in a partial block; K = 200 ends in a partial group.
    codes, scale_inv, scale_row = fp8_operands([40, 24], 200, (16, 64), device)
    bias = activations(64, 1, torch.float32, device, 7).reshape(64).to(dtype)
    x = activations(m, 200, dtype, device)
    out = poison(torch.empty((m, 64), dtype=dtype, device=device))
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, bias, out=out, config=config)
    assert y is out
    ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 64, bias.cpu())
    torch.testing.assert_close(y.cpu().float(), ref.float(), **tol(dtype))


@pytest.mark.parametrize("m,config", [(1, F8.Fp8Config(1, 4, 2, 1, 1, 4)), (1, F8.Fp8Config(1, 8, 2, 1, 1, 2)),
                                      (2, F8.Fp8Config(2, 16, 2, 1, 1, 1))])
def test_fp8_row_streaming_whole_tiles_match_the_reference(m, config, device):
    """K = 512 and N = 64 in whole tiles (the unmasked loads), with bias."""
    codes, scale_inv, scale_row = fp8_operands([40, 24], 512, (16, 128), device)
    bias = activations(64, 1, torch.float32, device, 7).reshape(64)
    x = activations(m, 512, torch.float32, device) * 4
    out = poison(torch.empty((m, 64), dtype=torch.float32, device=device))
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, bias, out=out, config=config)
    ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 128, bias.cpu())
    torch.testing.assert_close(y.cpu(), ref, **tol(torch.float32))


@pytest.mark.parametrize("k", [512, 456], ids=["whole_steps", "partial_step"])
@pytest.mark.parametrize("block_n", [8, 32])
def test_fp8_row_streaming_one_row_folds_uniform_scales_into_the_row(k, block_n, device, monkeypatch):
    """One row on 128-row scale blocks (Qwen3-FP8's grid): every program's rows share a scale row, so both scales
    fold into the activation row (W_SCALE_UNIFORM); other grids (16-row blocks here, which a 32-row program spans
    two of) keep the per-row scales. Both equal the W8A8 reference; the launches are spied for the form that ran."""
    spy = LaunchSpy(F8._fp8_rows_kernel)
    monkeypatch.setattr(F8, "_fp8_rows_kernel", spy)
    for rows_a_block in (128, 16):
        codes, scale_inv, scale_row = fp8_operands([128, 128], k, (rows_a_block, 128), device)
        x = activations(1, k, torch.float32, device, 11) * 3
        y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, config=F8.Fp8Config(1, block_n, 2, 1, 1, 4))
        ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 128, None)
        torch.testing.assert_close(y.cpu(), ref, **tol(torch.float32))
    assert [launch["W_SCALE_UNIFORM"] for launch in spy.launches] == [True, False]
    # under PDL where the device has it (never on CPU or the interpreter)
    assert [launch["USE_PDL"] for launch in spy.launches] == [F8.pdl_launch(torch.device(device))["USE_PDL"]] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,splits", [(1, 1), (5, 2), (8, 4)])
def test_fp8_decode_quantizes_its_own_activations_as_the_reference(m, splits, dtype, device):
    """The skinny kernel quantizes x in its K loop: rows far apart in magnitude (each group its own scale), a
    zero row (scale 1) and a partial last group must give the reference's codes, so the outputs agree to fp32
    summation order (a code one e4m3 step off moves an output by ~1e-2 of its size)."""
    codes, scale_inv, scale_row = fp8_operands([40, 24], 200, (16, 64), device)
    x = activations(m, 200, torch.float32, device) * torch.logspace(-3, 3, m).reshape(m, 1).to(device)
    x[m // 2, :] = 0
    x[0, 64:128] *= 50  # one group of the first row far above the others
    x = x.to(dtype)
    out = poison(torch.empty((m, 64), dtype=torch.float32, device=device))
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, out=out,
                            config=F8.Fp8Config(F8.next_pow2(m), 16, 4, 1, splits))
    ref = ref_fp8_linear(x.cpu().float(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 64, None)
    torch.testing.assert_close(y.cpu(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("m,config", [(65, None), (130, None), (257, None),
                                      (65, F8.Fp8Config(64, 32, 4, 4, 3)), (130, F8.Fp8Config(64, 16, 4, 4, 2)),
                                      (257, F8.Fp8Config(128, 64, 8, 3, 4))])
def test_fp8_mid_row_tiles_match_the_w8a8_reference(m, config, device):
    """65-257 rows (decode batches past 64): partial 64- and 128-row tiles, 64 columns in partial scale blocks
    (parts 40 and 24 in blocks of 16), K = 200 ending in a partial group, split-K with a bias added once."""
    codes, scale_inv, scale_row = fp8_operands([40, 24], 200, (16, 64), device)
    bias = activations(64, 1, torch.float32, device, 7).reshape(64).to(torch.bfloat16)
    x = activations(m, 200, torch.bfloat16, device) * torch.logspace(-2, 2, m).reshape(m, 1).to(device=device,
                                                                                          dtype=torch.bfloat16)
    out = poison(torch.empty((m, 64), dtype=torch.bfloat16, device=device))
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, bias, out=out, config=config)
    assert y is out
    ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 64, bias.cpu())
    torch.testing.assert_close(y.cpu().float(), ref.float(), **tol(torch.bfloat16))


@pytest.mark.parametrize("m,config", [(3, F8.Fp8Config(4, 32, 2, 1, 2)), (20, F8.Fp8Config(16, 64, 4, 1, 3)),
                                      (70, F8.Fp8Config(64, 128, 4, 1, 1))])
def test_fp8_tiles_in_one_scale_block_match_the_general_path_bit_for_bit(m, config, device):
    """Regular 128-row scale blocks (parts 256 + 64: the last block partial, N = 320 a partial 128-column tile)
    with column tiles dividing 128 take one weight scale per group: the same fp32 products as the per-column
    path, so the same bits, and the reference's values."""
    codes, scale_inv, scale_row = fp8_operands([256, 64], 384, (128, 128), device)
    assert F8._uniform_tiles(config.block_n, scale_row)
    x = activations(m, 384, torch.float32, device) * 3
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, config=config)
    irregular = scale_row.clone()  # same values, unknown to the regularity memo, so checked again: force it off
    F8.fp8_scaled_mm._regular[id(irregular)] = (lambda: irregular, False)
    general = F8.fp8_block_linear(x, codes, scale_inv, irregular, 128, config=config)
    assert torch.equal(y, general)
    ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 128, None)
    torch.testing.assert_close(y.cpu(), ref, **tol(torch.float32))


def test_fp8_activation_quant_pads_rows_with_zeros(device):
    """The cuBLAS path's layout: codes with rows past M, scales M-major (a transposed view): the real rows equal
    the reference's, the padding is codes 0 and scale 1."""
    x = activations(5, 200, torch.bfloat16, device) * 3
    codes = torch.full((8, 200), 1.0, device=device).to(torch.float8_e4m3fn)
    scales_t = torch.full((4, 8), float("nan"), device=device)
    F8.fp8_quantize_activation(x, 64, codes, scales_t.t())
    ref_codes, ref_scales = quantize_activation_fp8(x.cpu(), 64)
    assert torch.equal(codes[:5].cpu().view(torch.uint8), ref_codes.contiguous().view(torch.uint8))
    assert torch.equal(scales_t.t()[:5].cpu(), ref_scales)
    assert not codes[5:].cpu().view(torch.uint8).any() and bool((scales_t.t()[5:] == 1).all())


def test_fp8_scaled_mm_stays_off_without_a_hopper_gpu(device):
    """On CPU / the interpreter the cuBLAS path is never probed: 80 rows of a regular 128-block weight take the
    Triton kernel and match the reference."""
    codes, scale_inv, scale_row = fp8_operands([256], 512, (128, 128), device)
    x = activations(80, 512, torch.bfloat16, device)
    if device == "cpu":
        assert not F8.fp8_scaled_mm.available(x.device, None, None)
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128)
    ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 128, None)
    torch.testing.assert_close(y.cpu().float(), ref.float(), **tol(torch.bfloat16))


# ------------------------------------------------------------------ on the GPU

def _emulated_block_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, out=None):
    """torch._scaled_mm's DeepSeek recipe as cuBLASLt reads it (the layouts torch checks: a row-major, b column-major,
    scale_a `[M, L]` M-major, scale_b `[L4, N/128]` with strides `(1, L4)`), in fp32 on the CPU."""
    (m, k), n = a.shape, b.shape[1]
    blocks = -(-k // 128)
    assert a.stride() == (k, 1) and b.stride() == (1, k)
    assert scale_a.shape == (m, blocks) and scale_a.stride() == (1, m) and m % 4 == 0
    assert scale_b.shape == (blocks, -(-n // 128)) and scale_b.stride() == (1, -(-blocks // 4) * 4)
    y = torch.zeros((m, n))
    for g in range(blocks):
        part = a[:, g * 128:(g + 1) * 128].float() @ b[g * 128:(g + 1) * 128].float()
        y += part * scale_a[:, g, None] * scale_b[g].repeat_interleave(128)[None, :n]
    y = (y + (bias.float() if bias is not None else 0)).to(out_dtype)
    return out.copy_(y) if out is not None else y


@pytest.mark.parametrize("m,with_out", [(65, False), (130, True), (132, True)])
def test_fp8_scaled_mm_operands_have_the_recipe_layout(m, with_out, device, monkeypatch):
    """The cuBLAS path's host side on CPU, with torch._scaled_mm emulated: rows padded to a multiple of 4 (65, 130)
    or not (132), M-major activation scales, the weight scales' transpose, a bias, the result in `out` or a view
    of the real rows; it must give the W8A8 reference."""
    if device != "cpu":
        pytest.skip("emulates torch._scaled_mm on CPU tensors")
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_block_scaled_mm)
    codes, scale_inv, scale_row = fp8_operands([256, 128], 512, (128, 128), device)
    bias = activations(384, 1, torch.float32, device, 7).reshape(384).to(torch.bfloat16)
    x = activations(m, 512, torch.bfloat16, device)
    out = poison(torch.empty((m, 384), dtype=torch.bfloat16)) if with_out else None
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, bias, out=out,
                            config=F8.Fp8Config(0, 0, 0, 0, scaled_mm=True))
    assert y.shape == (m, 384) and y.is_contiguous() and (y is out if with_out else True)
    ref = ref_fp8_linear(x, codes, scale_inv, scale_row, 128, bias)
    torch.testing.assert_close(y.float(), ref.float(), **tol(torch.bfloat16))


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 33, 257])
def test_awq_qwen3_4b_shapes_on_gpu(m):
    for n, k in QWEN3_4B:
        qweight, qzeros, scales = awq_operands(n, k, 128, "cuda", seed=n)
        x = activations(m, k, torch.bfloat16, "cuda")
        y = A.awq_linear(x, qweight, qzeros, scales)
        ref = _awq_reference(x, qweight, qzeros, scales)
        torch.testing.assert_close(y.float().cpu(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


def _programs(m: int, n: int, k: int) -> int:
    cfg = F8.default_config(m, n, k, 128)
    splits = F8.split_k.steps_per_split(-(-k // 128), cfg.k_splits)[1]
    return -(-m // cfg.block_m) * -(-n // cfg.block_n) * splits


@pytest.mark.parametrize("m", [65, 96, 128, 192, 256])
def test_fp8_decode_batches_past_64_rows_fill_the_gpu(m):
    """Qwen3-4B's projections at 65-256 rows: 64-row tiles and at least one program per SM (128x128 tiles gave
    the down projection 2 x 20 = 40 programs at 256 rows); where K is split, the fp32 workspace traffic stays
    within the weight's bytes."""
    for n, k in QWEN3_4B:
        cfg = F8.default_config(m, n, k, 128)
        assert cfg.block_m == 64 and not cfg.scaled_mm
        assert _programs(m, n, k) >= F8.SMS
        assert cfg.k_splits == 1 or 8 * m * cfg.k_splits <= k
    # the narrow projections, the worst case of the old tiles, reach two programs per SM
    assert _programs(m, 2560, 9728) >= F8.MID_PROGRAMS


@pytest.mark.parametrize("m", [1, 2, 8])
def test_fp8_decode_rows_take_the_tensor_core_tiles(m):
    """One row too (the CUDA-core kernel that quantizes its own activations made the Qwen3-4B batch-1 step 4.02 ms
    on the H200 against 2.69 for two rows in the tiles): 16-row tiles of 64 columns, K split."""
    for n, k in QWEN3_4B:
        cfg = F8.default_config(m, n, k, 128)
        assert (cfg.block_m, cfg.block_n, cfg.row_groups, cfg.scaled_mm) == (16, 64, 0, False)
        assert cfg.block_m > F8.SKINNY_MAX_M and cfg.k_splits >= 1


@pytest.mark.parametrize("m", [1024, 2048])
def test_fp8_prefill_keeps_whole_128_tiles(m):
    for n, k in QWEN3_4B:
        assert F8.default_config(m, n, k, 128) == F8.Fp8Config(128, 128, 8, 3, 1)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [65, 128, 257, 2048])
def test_fp8_scaled_mm_path_matches_the_triton_kernel_on_gpu(m):
    """cuBLASLt's block-scaled GEMM (explicitly, and as the default from 65 rows) against the Triton tiles at
    Qwen3-4B's shapes; 65 and 257 rows exercise the row padding."""
    if not F8.scaled_mm_available(torch.device("cuda")):
        pytest.skip("no block-scaled torch._scaled_mm on this GPU / torch")
    for n, k in QWEN3_4B:
        codes, scale_inv, scale_row = fp8_operands([n], k, (128, 128), "cuda", seed=n)
        x = activations(m, k, torch.bfloat16, "cuda")
        y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, config=F8.Fp8Config(0, 0, 0, 0, scaled_mm=True))
        triton_y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, config=F8.default_config(m, n, k, 128))
        assert y.shape == (m, n) and y.is_contiguous()
        torch.testing.assert_close(y.float(), triton_y.float(), atol=1e-2 * triton_y.abs().max().item(), rtol=2e-2)
        # cuBLASLt need not pick the same algorithm every call: agreement to a bf16 rounding, not bits
        same = dict(atol=1e-3 * y.abs().max().item(), rtol=1e-2)
        torch.testing.assert_close(F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128), y, **same)
        out = poison(torch.empty((m, n), dtype=torch.bfloat16, device="cuda"))
        assert F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128, out=out) is out
        torch.testing.assert_close(out, y, **same)


@gpu
@needs_cuda
def test_fp8_partial_scale_blocks_keep_the_triton_kernel_on_gpu():
    """SmolLM2-like fused parts (576 + 192 + 192 rows: partial 128-blocks) at 96 rows: the scale rows are not the
    regular grid, so the default is the Triton kernel whatever the device offers, and it matches the reference."""
    codes, scale_inv, scale_row = fp8_operands([576, 192, 192], 1024, (128, 128), "cuda")
    x = activations(96, 1024, torch.bfloat16, "cuda")
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128)
    assert torch.equal(y, F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128,
                                              config=F8.default_config(96, 960, 1024, 128)))
    ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 128, None).float()
    torch.testing.assert_close(y.float().cpu(), ref, atol=1e-2 * ref.abs().max().item(), rtol=2e-2)


@gpu
@needs_cuda
def test_fp8_scaled_mm_path_replays_in_a_cuda_graph():
    """96 rows of Qwen3-4B's o_proj (the cuBLAS path where the device has it): captured, then replayed on new
    input, it gives what an eager call gives."""
    n, k, m = 2560, 4096, 96
    operands = fp8_operands([n], k, (128, 128), "cuda")
    x = activations(m, k, torch.bfloat16, "cuda")
    eager = F8.fp8_block_linear(x, *operands, 128)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = F8.fp8_block_linear(x, *operands, 128)
    x.copy_(activations(m, k, torch.bfloat16, "cuda", seed=5))
    graph.replay()
    expected = F8.fp8_block_linear(x, *operands, 128)
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, expected, atol=1e-3 * expected.abs().max().item(), rtol=1e-2)
    assert (captured.float() - eager.float()).abs().max() > 0.1 * eager.abs().max()


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 33, 257])
def test_fp8_qwen3_4b_shapes_on_gpu(m):
    for n, k in QWEN3_4B + ((576 + 192 + 192, 576),):  # and SmolLM2's qkv: partial blocks both ways
        parts = [576, 192, 192] if k == 576 else [n]
        codes, scale_inv, scale_row = fp8_operands(parts, k, (128, 128), "cuda", seed=n)
        x = activations(m, k, torch.bfloat16, "cuda")
        xq, xs = F8.fp8_quantize_activation(x, 128)
        ref_q, ref_s = quantize_activation_fp8(x.cpu(), 128)
        assert torch.equal(xs.cpu(), ref_s)
        assert torch.equal(xq.cpu().view(torch.uint8), ref_q.contiguous().view(torch.uint8))
        y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 128)
        ref = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), 128, None).float()
        torch.testing.assert_close(y.float().cpu(), ref, atol=1e-2 * ref.abs().max().item(), rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["awq", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 40])
def test_quantized_gemms_replay_in_a_cuda_graph(fmt, m):
    n, k = 2560, 4096
    x = activations(m, k, torch.bfloat16, "cuda")
    if fmt == "awq":
        operands = awq_operands(n, k, 128, "cuda")
        run = lambda: A.awq_linear(x, *operands)  # noqa: E731
    else:
        operands = fp8_operands([n], k, (128, 128), "cuda")
        run = lambda: F8.fp8_block_linear(x, *operands, 128)  # noqa: E731
    eager = run()
    torch.cuda.synchronize()
    run()  # warm-up outside the capture (Triton compiles here)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x.copy_(activations(m, k, torch.bfloat16, "cuda", seed=5))
    graph.replay()
    expected = run()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected) and not torch.equal(captured, eager)


# ------------------------------------------------------------------ the RMSNorm done by the quantization pass

def _norm_inputs(m: int, k: int, dtype: torch.dtype, device: str):
    x = activations(m, k, dtype, device) * torch.logspace(-2, 2, m).reshape(m, 1).to(device=device, dtype=dtype)
    residual = activations(m, k, dtype, device, seed=3)
    weight = (1 + 0.1 * activations(1, k, torch.float32, device, seed=4)).reshape(k).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,group,with_residual", [(200, 64, True), (576, 128, True), (256, 128, False),
                                                   (96, 128, True)])  # partial last groups; one under a group
def test_fp8_norm_quantize_equals_the_norm_kernel_then_the_quantization_bit_for_bit(k, group, with_residual, dtype,
                                                                                   device):
    from infer_backend_cuda.kernels import add_rms_norm, rms_norm

    x, residual, weight = _norm_inputs(5, k, dtype, device)
    x[1] = 0
    if with_residual:
        residual[1] = 0  # a zero row: rstd of eps alone, codes 0 and scale 1
        normed, ref_stream = add_rms_norm(x, residual, weight, 1e-6)
    else:
        normed, ref_stream = rms_norm(x, weight, 1e-6), None
    ref_codes, ref_scales = F8.fp8_quantize_activation(normed, group)
    stream = poison(torch.empty_like(x)) if with_residual else None
    norm = F8.NormPrologue(residual if with_residual else None, weight, 1e-6, stream)
    codes, scales = F8.fp8_norm_quantize(x, norm, group)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    if with_residual:
        assert torch.equal(stream, ref_stream)


def test_fp8_norm_quantize_pads_rows_with_zeros_in_the_cublas_layout(device):
    x, residual, weight = _norm_inputs(5, 200, torch.bfloat16, device)
    stream = torch.empty_like(x)
    codes = torch.full((8, 200), 1.0, device=device).to(torch.float8_e4m3fn)
    scales_t = torch.full((4, 8), float("nan"), device=device)
    F8.fp8_norm_quantize(x, F8.NormPrologue(residual, weight, 1e-6, stream), 64, codes, scales_t.t())
    from infer_backend_cuda.kernels import add_rms_norm

    ref_codes, ref_scales = F8.fp8_quantize_activation(add_rms_norm(x, residual, weight, 1e-6)[0], 64)
    assert torch.equal(codes[:5].view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales_t.t()[:5], ref_scales)
    assert not codes[5:].view(torch.uint8).any() and bool((scales_t.t()[5:] == 1).all())


def test_fp8_norm_quantize_refuses_a_residual_without_its_output(device):
    x, residual, weight = _norm_inputs(2, 128, torch.float32, device)
    with pytest.raises(ValueError, match="residual_out"):
        F8.fp8_norm_quantize(x, F8.NormPrologue(residual, weight, 1e-6, None), 64)
    assert not F8.norm_quant_fits(256, 96)  # groups are powers of two


@pytest.mark.parametrize("m,config", [(3, None), (20, F8.Fp8Config(16, 32, 4, 1, 3)), (70, None),
                                      (2, F8.Fp8Config(2, 16, 2, 1, 1, 1)),  # the row-streaming kernel
                                      (4, F8.Fp8Config(4, 16, 2, 1, 2))])  # CUDA-core: it takes the normed rows
def test_fp8_gemm_with_the_norm_prologue_equals_the_norm_then_the_gemm_bit_for_bit(m, config, device):
    from infer_backend_cuda.kernels import add_rms_norm

    codes, scale_inv, scale_row = fp8_operands([40, 24], 200, (16, 64), device)
    bias = activations(64, 1, torch.float32, device, 7).reshape(64).to(torch.bfloat16)
    x, residual, weight = _norm_inputs(m, 200, torch.bfloat16, device)
    normed, ref_stream = add_rms_norm(x, residual, weight, 1e-5)
    ref = F8.fp8_block_linear(normed, codes, scale_inv, scale_row, 64, bias, config=config)
    stream = poison(torch.empty_like(x))
    y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, 64, bias, config=config,
                            norm=F8.NormPrologue(residual, weight, 1e-5, stream))
    assert torch.equal(y, ref) and torch.equal(stream, ref_stream)


@pytest.mark.parametrize("rows", [1, 9, 66])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fp8_linear_ops_fold_the_norm_into_the_quantization_with_the_switch(rows, with_residual, device,
                                                                            monkeypatch):
    """`Fp8BlockLinearOps.add_rms_norm_linear` with INFER_CUDA_FP8_NORM_QUANT on gives the bits of the default
    (the norm kernel, then the GEMM), the new residual too, on `[T, H]` activations."""
    from infer_backend_cuda import linear_ops
    from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
    from infer_core.quant import QuantScheme

    scheme = QuantScheme.fp8_block(16, 64)
    fp8 = linear_ops.CudaLinears(CudaMathOps(), TritonFusedOps(CudaMathOps())).bind(scheme)
    weight = fp8_operands([40, 24], 200, (16, 64), device)
    x, residual, norm_weight = _norm_inputs(rows, 200, torch.bfloat16, device)
    res = residual if with_residual else None
    monkeypatch.setattr(linear_ops, "FP8_NORM_QUANT", False)
    ref, ref_stream = fp8.add_rms_norm_linear(x, res, norm_weight, 1e-6, weight, None)
    monkeypatch.setattr(linear_ops, "FP8_NORM_QUANT", True)
    y, stream = fp8.add_rms_norm_linear(x, res, norm_weight, 1e-6, weight, None)
    assert torch.equal(y, ref) and torch.equal(stream, ref_stream)
    assert (stream is x) == (not with_residual)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 40, 96, 257])
def test_fp8_norm_prologue_on_qwen3_4b_shapes_equals_the_norm_then_the_gemm_and_replays_in_a_graph(m):
    """The qkv and gate / up GEMMs of Qwen3-4B (their inputs are normed) through every route on the GPU (tiles,
    split-K, cuBLASLt from 65 rows): the same bits as the norm kernel then the GEMM, eagerly and replayed."""
    from infer_backend_cuda.kernels import add_rms_norm

    for n in (6144, 19456):
        operands = fp8_operands([n], 2560, (128, 128), "cuda", seed=n)
        x, residual, weight = _norm_inputs(m, 2560, torch.bfloat16, "cuda")
        normed, ref_stream = add_rms_norm(x, residual, weight, 1e-6)
        ref = F8.fp8_block_linear(normed, *operands, 128)
        stream = torch.empty_like(x)
        norm = F8.NormPrologue(residual, weight, 1e-6, stream)
        y = F8.fp8_block_linear(x, *operands, 128, norm=norm)
        assert torch.equal(y, ref) and torch.equal(stream, ref_stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = F8.fp8_block_linear(x, *operands, 128, norm=norm)
        x.copy_(activations(m, 2560, torch.bfloat16, "cuda", seed=5))
        graph.replay()
        normed, ref_stream = add_rms_norm(x, residual, weight, 1e-6)
        expected = F8.fp8_block_linear(normed, *operands, 128)
        torch.cuda.synchronize()
        assert torch.equal(captured, expected) and torch.equal(stream, ref_stream)
