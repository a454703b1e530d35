"""bench/tune_awq_in_model.py's parts that need no GPU: the AWQ linears' shapes read off a loaded model, the candidate
configs (each one runnable and right, in the interpreter), the one-row table override and its restoration, and the
winners written as table entries that the kernel module reads back (the replays themselves run on the device)."""

from __future__ import annotations

from pathlib import Path

import torch

from infer_backend_cuda.kernels import awq_gemm as A, tuned_table
from tests.backend_cuda.quant_operands import activations
from tests.bench.scripts import load_bench_script
from tests.worker.quant_checkpoints import awq_config, quantize_awq, write_quantized
from tests.worker.tiny_checkpoints import Engine, llama_config, random_hf_model

tune = load_bench_script("tune_awq_in_model")


def test_awq_shapes_by_linear_name(tmp_path: Path) -> None:
    config = llama_config(hidden_size=128, intermediate_size=256)
    write_quantized(random_hf_model(config, seed=3).state_dict(), config.to_dict(), tmp_path, awq_config(32),
                    torch.float32)
    shapes = tune.awq_shapes(Engine.open(tmp_path).model)
    head_dim = config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    assert shapes == {"down_proj": (128, 256, 32), "gate_up_proj": (512, 128, 32), "o_proj": (128, 128, 32),
                      "qkv_proj": (qkv, 128, 32)}  # lm_head is dense: not tuned here


def test_candidates_at_qwen3_4b_shapes_are_distinct_and_cover_the_forms() -> None:
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
        found = tune.candidates(n, k, 128)
        assert len(found) == len(set(found)) >= 10
        assert found[0] == A.default_config(1, n, k, 128)
        gemv = [c for c in found if c.block_m == 1]
        assert {(c.block_n, c.block_k, c.num_warps) for c in gemv} >= set(tune.GEMV_FORMS)
        assert {c.k_splits for c in gemv} >= {k // 128, (k // 128 + 1) // 2}  # one and two groups a program
        assert any(c.block_m == 16 for c in found)  # the tiled kernel's decode tile


def test_every_candidate_runs_and_is_right() -> None:
    """In the interpreter without a GPU (the suite's conftest), on the GPU where there is one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, k, group = 80, 256, 64
    tensors, dense = quantize_awq(torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05, group)
    operands = [tensors[name].to(device) for name in ("qweight", "qzeros", "scales")]
    x = activations(1, k, torch.float32, device, seed=2)
    expected = x @ dense.to(device).t()
    for cfg in tune.candidates(n, k, group):
        torch.testing.assert_close(A.awq_linear(x, *operands, config=cfg), expected, atol=2e-4, rtol=2e-4,
                                   msg=lambda m, cfg=cfg: f"{cfg}: {m}")


def test_one_row_override_answers_inside_and_is_restored(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(A, "_tuned_table", lambda name: {(16, 10, 20, 4): A.AwqConfig(16, 64, 4, 4, 3)})
    before = A._tuned_table
    picked = A.AwqConfig(1, 64, 8, 1, 1, 3)
    with tune.one_row_configs({(80, 256, 64): picked}):
        table = A._tuned_table("any GPU")
        assert table[(1, 80, 256, 64)] == picked
        assert table[(16, 10, 20, 4)] == A.AwqConfig(16, 64, 4, 4, 3)  # other entries kept
    assert A._tuned_table is before


def test_winners_merge_into_a_table_the_kernel_module_reads(tmp_path: Path) -> None:
    path = tmp_path / "awq_gemm.json"
    tuned_table.merge(path, "GPU X", [{"m": 16, "n": 1, "k": 2, "group": 3, "config": [16, 64, 128, 4, 3, 2, False],
                                       "us": 1.0}], A.table_key)
    chosen = {(6144, 2560, 128): A.AwqConfig(1, 64, 8, 1, 1, 20)}
    tuned_table.merge(path, "GPU X", tune.table_entries(chosen, {(6144, 2560, 128): 2.2345678}), A.table_key)
    entries = tuned_table.entries(path, "GPU X")
    read = {A.table_key(e): A.AwqConfig(*e["config"]) for e in entries}
    assert read == {(1, 6144, 2560, 128): chosen[(6144, 2560, 128)], (16, 1, 2, 3): A.AwqConfig(16, 64, 128, 4, 3, 2)}
    assert next(e for e in entries if e["m"] == 1)["replay_ms"] == 2.2346
