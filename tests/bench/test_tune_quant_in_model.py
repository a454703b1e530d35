"""bench/tune_quant_in_model.py's parts that need no GPU: the quantized linears' shapes read off a loaded model, each
scheme's candidate configs (each one runnable and right, in the interpreter), the one-row overrides and their
restoration, and the winners written as table entries that the kernel modules read back (the replays themselves run
on the device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer_backend_cpu.quant_math import fp8_block_linear as ref_fp8_linear
from infer_backend_cuda.kernels import awq_gemm as A
from infer_backend_cuda.kernels import fp8_gemm as F8
from infer_backend_cuda.kernels import mid_gemm as G
from infer_backend_cuda.kernels import tuned_table
from infer_backend_cuda.kernels.activation import silu_and_mul
from infer_core.quant import QuantMethod
from tests.backend_cuda.quant_operands import QWEN3_4B, activations, fp8_operands
from tests.backend_cuda.reference import ref_silu_and_mul
from tests.bench.scripts import load_bench_script
from tests.worker.quant_checkpoints import awq_config, fp8_config, quantize_awq, write_quantized
from tests.worker.tiny_checkpoints import Engine, llama_config, random_hf_model

tune = load_bench_script("tune_quant_in_model")
AWQ, FP8 = tune.AwqTuner(), tune.Fp8Tuner()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter without a GPU (the suite's conftest)


@pytest.mark.parametrize("scheme", ["awq", "fp8"])
def test_quantized_shapes_by_linear_name(scheme: str, tmp_path: Path) -> None:
    config = llama_config(hidden_size=128, intermediate_size=256)
    quant = awq_config(32) if scheme == "awq" else fp8_config((32, 32))
    write_quantized(random_hf_model(config, seed=3).state_dict(), config.to_dict(), tmp_path, quant, torch.float32)
    method = QuantMethod.AWQ if scheme == "awq" else QuantMethod.FP8_BLOCK
    shapes = tune.quant_shapes(Engine.open(tmp_path).model, method)
    head_dim = config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    assert shapes == {"down_proj": (128, 256, 32), "gate_up_proj": (512, 128, 32), "o_proj": (128, 128, 32),
                      "qkv_proj": (qkv, 128, 32)}  # lm_head is dense: not tuned here
    other = QuantMethod.FP8_BLOCK if scheme == "awq" else QuantMethod.AWQ
    assert tune.quant_shapes(Engine.open(tmp_path).model, other) == {}


def test_awq_candidates_at_qwen3_4b_shapes_are_distinct_and_cover_the_forms() -> None:
    for n, k in QWEN3_4B:
        found = AWQ.candidates("any", (n, k, 128))
        assert len(found) == len(set(found)) >= 10
        assert found[0] == A.default_config(1, n, k, 128)
        gemv = [c for c in found if c.block_m == 1]
        assert {(c.block_n, c.block_k, c.num_warps) for c in gemv} >= set(tune.GEMV_FORMS)
        assert {c.k_splits for c in gemv} >= {k // 128, (k // 128 + 1) // 2}  # one and two groups a program
        assert any(c.block_m == 16 for c in found)  # the tiled kernel's decode tile


def test_fp8_candidates_at_qwen3_4b_shapes_cover_both_kernels_and_the_gated_epilogue() -> None:
    for n, k in QWEN3_4B:
        for attr in ("qkv_proj", tune.GATED_LINEAR):
            found = FP8.candidates(attr, (n, k, 128))
            assert len(found) == len(set(found)) >= 10
            assert found[0] == F8.default_config(1, n, k, 128)
            mids = [c for c in found if isinstance(c, G.MidConfig)]
            assert {(c.block_n, c.num_warps, c.num_stages) for c in mids} == set(tune.MID_FORMS)
            assert all(c.block_k == 128 for c in mids)  # the mid GEMM steps K a group at a time
            splits = {c.k_splits for c in mids}
            assert splits == ({1} if attr == tune.GATED_LINEAR else {1, 2, 4, 8})  # gated: one K range
            tiles = [c for c in found if isinstance(c, F8.Fp8Config)]
            assert any(c.block_m == 1 for c in tiles) and any(c.block_m == 16 for c in tiles)


def test_every_awq_candidate_runs_and_is_right() -> None:
    n, k, group = 80, 256, 64
    tensors, dense = quantize_awq(torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05, group)
    operands = [tensors[name].to(DEVICE) for name in ("qweight", "qzeros", "scales")]
    x = activations(1, k, torch.float32, DEVICE, seed=2)
    expected = x @ dense.to(DEVICE).t()
    for cfg in AWQ.candidates("any", (n, k, group)):
        torch.testing.assert_close(A.awq_linear(x, *operands, config=cfg), expected, atol=2e-4, rtol=2e-4,
                                   msg=lambda m, cfg=cfg: f"{cfg}: {m}")


@pytest.mark.parametrize("attr", ["o_proj", tune.GATED_LINEAR])
def test_every_fp8_candidate_runs_and_is_right(attr: str) -> None:
    """Each candidate as the step would run it: inside the override, through the FP8 entry points (the gated linear
    through its SiLU-and-mul one), against the CPU's W8A8 reference."""
    n, k, group = 256, 384, 128  # two 128-row scale blocks; three groups, so splits of 4 and 8 clamp
    codes, scale_inv, scale_row = fp8_operands([n], k, (128, group), DEVICE, seed=4)
    x = activations(1, k, torch.float32, DEVICE, seed=5)
    expected = ref_fp8_linear(x.cpu(), codes.cpu(), scale_inv.cpu(), scale_row.cpu(), group, None)
    gated = attr == tune.GATED_LINEAR
    if gated:
        expected = ref_silu_and_mul(expected)
    for cfg in FP8.candidates(attr, (n, k, group)):
        with FP8.one_row({(n, k, group): cfg}):
            if gated:
                y = F8.fp8_block_linear_silu_mul(x, codes, scale_inv, scale_row, group)
            else:
                y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, group)
        torch.testing.assert_close(y.cpu(), expected, atol=2e-4, rtol=2e-4, msg=lambda m, cfg=cfg: f"{cfg}: {m}")


def test_awq_one_row_override_answers_inside_and_is_restored(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(A, "_tuned_table", lambda name: {(16, 10, 20, 4): A.AwqConfig(16, 64, 4, 4, 3)})
    before = A._tuned_table
    picked = A.AwqConfig(1, 64, 8, 1, 1, 3)
    with AWQ.one_row({(80, 256, 64): picked}):
        table = A._tuned_table("any GPU")
        assert table[(1, 80, 256, 64)] == picked
        assert table[(16, 10, 20, 4)] == A.AwqConfig(16, 64, 4, 4, 3)  # other entries kept
    assert A._tuned_table is before


def test_fp8_one_row_override_routes_each_kind_and_is_restored(monkeypatch) -> None:  # noqa: ANN001
    table_mid = G.MidConfig(64, 128, 4, 4, 3)
    monkeypatch.setattr(F8, "mid_config", lambda op, m, n, k, group, device: table_mid)
    monkeypatch.setattr(F8, "choose_config", lambda m, n, k, group, device: None)
    before = (F8.mid_config, F8.choose_config)
    cpu = torch.device("cpu")
    tile, split_mid, one_range = F8.Fp8Config(16, 64, 4, 3, 5), G.MidConfig(128, 128, 4, 4, 2), G.MidConfig(
        128, 128, 8, 3, 1)
    with FP8.one_row({(10, 20, 128): tile, (30, 40, 128): split_mid, (50, 60, 128): one_range}):
        assert F8.mid_config("fp8_linear", 1, 10, 20, 128, cpu) is None  # the FP8 kernels' winner: no mid
        assert F8.choose_config(1, 10, 20, 128, cpu) == tile
        assert F8.mid_config("fp8_linear", 1, 30, 40, 128, cpu) == split_mid
        assert F8.mid_config("fp8_linear_silu_mul", 1, 30, 40, 128, cpu) is None  # gated takes one K range
        assert F8.choose_config(1, 30, 40, 128, cpu) is None
        assert F8.mid_config("fp8_linear_silu_mul", 1, 50, 60, 128, cpu) == one_range
        assert F8.mid_config("fp8_linear", 2, 10, 20, 128, cpu) == table_mid  # other rows and shapes: the tables
        assert F8.mid_config("fp8_linear", 1, 11, 20, 128, cpu) == table_mid
    assert (F8.mid_config, F8.choose_config) == before


def test_awq_winners_merge_into_a_table_the_kernel_module_reads(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    path = tmp_path / "awq_gemm.json"
    monkeypatch.setattr(A, "_TABLE", path)
    tuned_table.merge(path, "GPU X", [{"m": 16, "n": 1, "k": 2, "group": 3, "config": [16, 64, 128, 4, 3, 2, False],
                                       "us": 1.0}], A.table_key)
    shape, cfg = (6144, 2560, 128), A.AwqConfig(1, 64, 8, 1, 1, 20)
    AWQ.write_table({"qkv_proj": (shape, cfg)}, {"qkv_proj": 2.2345678}, "GPU X")
    entries = tuned_table.entries(path, "GPU X")
    read = {A.table_key(e): A.AwqConfig(*e["config"]) for e in entries}
    assert read == {(1, 6144, 2560, 128): cfg, (16, 1, 2, 3): A.AwqConfig(16, 64, 128, 4, 3, 2)}
    assert next(e for e in entries if e["m"] == 1)["replay_ms"] == 2.2346


def test_fp8_winners_merge_into_the_mid_and_fp8_tables(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A mid winner is a `use: true` mid entry (the gated op's where it has one K range); an FP8-kernel winner is an
    FP8 entry, and the shape's one-row mid entries, asked first, are turned off; the modules read both back."""
    mid_path, fp8_path = tmp_path / "mid_gemm.json", tmp_path / "fp8_gemm.json"
    monkeypatch.setattr(G, "_TABLE", mid_path)
    monkeypatch.setattr(F8, "_TABLE", fp8_path)
    old = {"m": 1, "use": True, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "k_splits": 3}
    tuned_table.merge(mid_path, "GPU X", [
        {"op": "fp8_linear", "n": 2560, "k": 4096, **old},
        {"op": "fp8_linear_silu_mul", "n": 19456, "k": 2560, **old, "k_splits": 1},
        {"op": "fp8_linear", "n": 19456, "k": 2560, **old},
        {"op": "fp8_linear", "n": 6144, "k": 2560, **old, "m": 2},
    ], G.table_key)
    tile, gated = F8.Fp8Config(16, 64, 4, 3, 8), G.MidConfig(128, 128, 8, 3, 1)
    split = G.MidConfig(128, 128, 4, 4, 2)
    FP8.write_table({"o_proj": ((2560, 4096, 128), tile), tune.GATED_LINEAR: ((19456, 2560, 128), gated),
                     "qkv_proj": ((6144, 2560, 128), split)},
                    {"o_proj": 2.5, tune.GATED_LINEAR: 2.4, "qkv_proj": 2.3}, "GPU X")
    G._tuned_table.cache_clear()
    F8._tuned_table.cache_clear()
    try:
        mids = G._tuned_table("GPU X")
        assert mids[("fp8_linear", 1, 2560, 4096)] is None  # turned off: the FP8 table's tile wins
        assert F8._tuned_table("GPU X")[(1, 2560, 4096, 128)] == tile
        assert mids[("fp8_linear_silu_mul", 1, 19456, 2560)] == gated
        assert mids[("fp8_linear", 1, 6144, 2560)] == split
        assert mids[("fp8_linear", 2, 6144, 2560)] == G.MidConfig(64, 128, 4, 4, 3)  # other rows kept
    finally:
        G._tuned_table.cache_clear()
        F8._tuned_table.cache_clear()
    fp8_entries = tuned_table.entries(fp8_path, "GPU X")
    assert [e["replay_ms"] for e in fp8_entries] == [2.5]
