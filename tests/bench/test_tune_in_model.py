"""bench/tune_in_model.py's parts that need no GPU: the linears' shapes read off a loaded model, each scheme's
candidate configs (each one runnable, right and on its path, in the interpreter), the overrides and their
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
from infer_backend_cuda.kernels import skinny_gemm as S
from infer_backend_cuda.kernels import tuned_table
from infer_backend_cuda.linear_ops import DenseLinearOps
from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
from infer_core.quant import DENSE, QuantMethod
from tests.backend_cuda.quant_operands import QWEN3_4B, activations, fp8_operands
from tests.backend_cuda.reference import rand_offset, ref_add_rms_norm, ref_linear, ref_silu_and_mul
from tests.bench.scripts import load_bench_script
from tests.worker.quant_checkpoints import awq_config, fp8_config, quantize_awq, write_quantized
from tests.worker.tiny_checkpoints import Engine, llama_config, random_hf_model

tune = load_bench_script("tune_in_model")
AWQ, FP8, DENSE2 = tune.AwqTuner(), tune.Fp8Tuner(), tune.DenseTuner(2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter without a GPU (the suite's conftest)


@pytest.mark.parametrize("scheme", ["awq", "fp8"])
def test_quantized_shapes_by_linear_name(scheme: str, tmp_path: Path) -> None:
    config = llama_config(hidden_size=128, intermediate_size=256)
    quant = awq_config(32) if scheme == "awq" else fp8_config((32, 32))
    write_quantized(random_hf_model(config, seed=3).state_dict(), config.to_dict(), tmp_path, quant, torch.float32)
    method = QuantMethod.AWQ if scheme == "awq" else QuantMethod.FP8_BLOCK
    shapes = tune.linear_shapes(Engine.open(tmp_path).model, method)
    head_dim = config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    assert shapes == {"down_proj": (128, 256, 32), "gate_up_proj": (512, 128, 32), "o_proj": (128, 128, 32),
                      "qkv_proj": (qkv, 128, 32)}  # lm_head is dense: not tuned here
    other = QuantMethod.FP8_BLOCK if scheme == "awq" else QuantMethod.AWQ
    assert tune.linear_shapes(Engine.open(tmp_path).model, other) == {}


def test_dense_shapes_include_the_lm_head(tmp_path: Path) -> None:
    config = llama_config(hidden_size=128, intermediate_size=256)
    write_quantized(random_hf_model(config, seed=3).state_dict(), config.to_dict(), tmp_path, awq_config(32),
                    torch.float32)
    assert tune.linear_shapes(Engine.open(tmp_path).model, QuantMethod.DENSE) == {
        "lm_head": (config.vocab_size, 128, 0)}  # the AWQ checkpoint's one dense linear


def test_tuner_takes_one_row_for_the_quantized_schemes() -> None:
    assert isinstance(tune.tuner("awq", 1), tune.AwqTuner) and isinstance(tune.tuner("fp8", 1), tune.Fp8Tuner)
    assert tune.tuner("dense", 4).rows == 4
    with pytest.raises(SystemExit, match="one row only"):
        tune.tuner("fp8", 2)
    with pytest.raises(ValueError, match="1..8 rows"):
        tune.tuner("dense", 9)


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
            rows = {(c.block_n, c.num_warps, c.row_groups) for c in tiles if c.row_groups}
            assert rows == set(tune.FP8_ROWS_FORMS) and all(c.block_m == 1 for c in tiles if c.row_groups)


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
        with FP8.override({(n, k, group): cfg}):
            if gated:
                y = F8.fp8_block_linear_silu_mul(x, codes, scale_inv, scale_row, group)
            else:
                y = F8.fp8_block_linear(x, codes, scale_inv, scale_row, group)
        torch.testing.assert_close(y.cpu(), expected, atol=2e-4, rtol=2e-4, msg=lambda m, cfg=cfg: f"{cfg}: {m}")


def test_awq_one_row_override_answers_inside_and_is_restored(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(A, "_tuned_table", lambda name: {(16, 10, 20, 4): A.AwqConfig(16, 64, 4, 4, 3)})
    before = A._tuned_table
    picked = A.AwqConfig(1, 64, 8, 1, 1, 3)
    with AWQ.override({(80, 256, 64): picked}):
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
    with FP8.override({(10, 20, 128): tile, (30, 40, 128): split_mid, (50, 60, 128): one_range}):
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


def test_fp8_incumbent_is_what_the_dispatch_runs(monkeypatch) -> None:  # noqa: ANN001
    """The FP8 tuner's incumbent: the mid table's entry of the op the dispatch asks for (the gated one for gate / up),
    else the default rule's tiles; a gate / up shape with only a plain mid entry (the GEMM, then the SiLU kernel) is
    refused with a message, not scored as the gated epilogue."""
    cpu, shape = torch.device("cpu"), (19456, 2560, 128)
    plain, gated = G.MidConfig(64, 128, 4, 4, 2), G.MidConfig(128, 128, 8, 3, 1)
    table: dict[str, G.MidConfig] = {}
    monkeypatch.setattr(F8, "mid_config", lambda op, m, n, k, group, device: table.get(op) if m == 1 else None)
    assert FP8.current(tune.GATED_LINEAR, shape, cpu) == F8.default_config(1, *shape)
    table.update(fp8_linear=plain, fp8_linear_silu_mul=gated)
    assert FP8.current(tune.GATED_LINEAR, shape, cpu) == gated
    assert FP8.current("o_proj", shape, cpu) == plain
    del table["fp8_linear_silu_mul"]
    with pytest.raises(ValueError, match="cannot score"):
        FP8.current(tune.GATED_LINEAR, shape, cpu)


def test_dense_candidates_at_qwen3_4b_shapes_cover_the_paths() -> None:
    for n, k in (*QWEN3_4B, (151936, 2560)):
        for attr in ("o_proj", tune.NORMED_LINEAR, tune.GATED_LINEAR):
            found = DENSE2.candidates(attr, (n, k, 0))
            assert len(found) == len(set(found)) >= 10
            paths = {c.path for c in found}
            assert paths == ({"cublas", "skinny", "mid"} | ({"norm_skinny"} if attr == tune.NORMED_LINEAR else set()))
            assert S.heuristic_config(2, n, k) in {c.config for c in found}
            mid_splits = {c.config.k_splits for c in found if c.path == "mid"}
            assert mid_splits == ({1} if attr == tune.GATED_LINEAR else set(tune.DENSE_MID_SPLITS))
            rowwise = [c.config for c in found if c.path != "cublas" and getattr(c.config, "rowwise", False)]
            assert rowwise and all(S.rowwise_fits(c, 2) for c in rowwise)
            if attr == tune.NORMED_LINEAR:
                assert any(c.path == "norm_skinny" and c.config.rowwise for c in found)
        assert "mid" not in {c.path for c in tune.DenseTuner(1).candidates("o_proj", (n, k, 0))}  # mid: 2+ rows
        assert not any(getattr(c.config, "rowwise", False) for c in tune.DenseTuner(4).candidates("o_proj", (n, k, 0)))


KERNELS = {"skinny": ("skinny_linear", "skinny_linear_silu_mul"), "norm_skinny": ("skinny_add_rms_norm_linear",) * 2,
           "mid": ("mid_linear", "mid_linear_silu_mul"), "cublas": (None, None)}


@pytest.mark.parametrize("attr", ["o_proj", tune.NORMED_LINEAR, tune.GATED_LINEAR])
def test_every_dense_candidate_runs_right_on_its_path(attr: str, monkeypatch) -> None:  # noqa: ANN001
    """Each candidate through the dense linear op the model calls for that linear (plain, norm + GEMM, norm + gated
    GEMM), inside the override at 2 rows: the kernel its path names runs (none for cuBLAS), with F.linear's answer."""
    ran: list[str] = []
    for module, names in ((S, ("skinny_linear", "skinny_linear_silu_mul", "skinny_add_rms_norm_linear")),
                          (G, ("mid_linear", "mid_linear_silu_mul"))):
        for name in names:
            kernel = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: (ran.append(_n), _k(*a, **kw))[1])
    math = CudaMathOps()
    ops = DenseLinearOps(math, TritonFusedOps(math), DENSE)
    n, k, eps = 64, 256, 1e-6
    w = rand_offset((n, k), torch.bfloat16, DEVICE, 1) * 0.05
    x, residual = (rand_offset((2, k), torch.bfloat16, DEVICE, seed) for seed in (2, 3))
    norm_w = rand_offset((k,), torch.bfloat16, DEVICE, 4)
    normed, _ = ref_add_rms_norm(x, residual, norm_w, eps)
    expected = ref_linear(normed if attr != "o_proj" else x, w)
    if attr == tune.GATED_LINEAR:
        expected = ref_silu_and_mul(expected)
    for choice in DENSE2.candidates(attr, (n, k, 0)):
        ran.clear()
        with DENSE2.override({(n, k, 0): choice}):
            if attr == "o_proj":
                y = ops.linear(x, (w,), None)
            elif attr == tune.NORMED_LINEAR:
                y, _ = ops.add_rms_norm_linear(x, residual, norm_w, eps, (w,), None)
            else:
                y, _ = ops.add_rms_norm_linear_silu_mul(x, residual, norm_w, eps, (w,), None)
        kernel = KERNELS[choice.path][attr == tune.GATED_LINEAR]
        assert ran == ([kernel] if kernel else []), choice
        torch.testing.assert_close(y.float(), expected.float(), atol=3e-2 * expected.abs().max().item(), rtol=3e-2,
                                   msg=lambda m, choice=choice: f"{choice}: {m}")


def test_dense_override_answers_at_its_rows_only_and_is_restored(monkeypatch) -> None:  # noqa: ANN001
    table_skinny, table_mid = S.SkinnyConfig(8, 256, 2, 1), G.MidConfig(64, 128, 4, 6)
    monkeypatch.setattr(S, "choose_config", lambda op, m, n, k, device: table_skinny)
    monkeypatch.setattr(G, "choose_config", lambda op, m, n, k, device: table_mid)
    before = (S.choose_config, G.choose_config)
    cpu = torch.device("cpu")
    normed, middle = tune.DenseChoice("norm_skinny", S.SkinnyConfig(4, 512, 2, 1)), tune.DenseChoice(
        "mid", G.MidConfig(128, 128, 4, 4, 2))
    with DENSE2.override({(10, 20, 0): normed, (30, 40, 0): middle, (50, 60, 0): tune.DenseChoice("cublas")}):
        assert S.choose_config("add_rms_norm_linear", 2, 10, 20, cpu) == normed.config
        assert S.choose_config("linear", 2, 10, 20, cpu) is None
        assert G.choose_config("linear", 2, 10, 20, cpu) is None
        assert S.choose_config("linear", 2, 30, 40, cpu) is None
        assert G.choose_config("linear_silu_mul", 2, 30, 40, cpu) == middle.config
        assert S.choose_config("linear", 2, 50, 60, cpu) is None and G.choose_config("linear", 2, 50, 60, cpu) is None
        assert S.choose_config("linear", 4, 10, 20, cpu) == table_skinny  # other rows, shapes and ops: the tables
        assert G.choose_config("linear", 2, 11, 20, cpu) == table_mid
        assert G.choose_config("fp8_linear", 2, 30, 40, cpu) == table_mid
    assert (S.choose_config, G.choose_config) == before


def test_dense_winners_merge_so_the_dispatch_takes_them(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """At 2 rows the skinny rule answers shapes its table lacks, so a mid or cuBLAS winner writes `use: false` skinny
    entries; a skinny winner turns its shape's mid entry off; the modules read the result back."""
    skinny_path, mid_path = tmp_path / "skinny_gemm.json", tmp_path / "mid_gemm.json"
    monkeypatch.setattr(S, "_TABLE", skinny_path)
    monkeypatch.setattr(G, "_TABLE", mid_path)
    old_mid = {"m": 2, "use": True, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 6, "k_splits": 1}
    tuned_table.merge(mid_path, "GPU X", [{"op": "linear", "n": 2560, "k": 4096, **old_mid},
                                          {"op": "linear", "n": 2560, "k": 9728, **old_mid}], G.table_key)
    old_skinny = {"m": 2, "use": True, "block_n": 8, "block_k": 256, "num_warps": 2, "num_stages": 1}
    tuned_table.merge(skinny_path, "GPU X", [{"op": "add_rms_norm_linear", "n": 6144, "k": 2560, **old_skinny},
                                             {"op": "linear", "n": 2560, "k": 9728, **old_skinny, "m": 4}],
                      S.table_key)
    plain, gated_mid = S.SkinnyConfig(2, 512, 4, 1), G.MidConfig(64, 128, 4, 6, 1)
    DENSE2.write_table({"o_proj": ((2560, 4096, 0), tune.DenseChoice("skinny", plain)),
                        tune.GATED_LINEAR: ((19456, 2560, 0), tune.DenseChoice("mid", gated_mid)),
                        "down_proj": ((2560, 9728, 0), tune.DenseChoice("cublas")),
                        tune.NORMED_LINEAR: ((6144, 2560, 0), tune.DenseChoice("skinny", plain))},
                       {"o_proj": 3.1, tune.GATED_LINEAR: 3.2, "down_proj": 3.3, tune.NORMED_LINEAR: 3.4}, "GPU X")
    for module in (S, G):
        module._tuned_table.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    cuda = torch.device("cuda")
    try:
        assert S.choose_config("linear", 2, 2560, 4096, cuda) == plain
        assert G._tuned_table("GPU X")[("linear", 2, 2560, 4096)] is None  # turned off under the skinny winner
        assert S.choose_config("linear", 2, 19456, 2560, cuda) is None  # the rule silenced: the mid GEMM's turn
        assert G.choose_config("linear_silu_mul", 2, 19456, 2560, cuda) == gated_mid
        assert S.choose_config("linear", 2, 2560, 9728, cuda) is None  # cuBLAS: neither answers
        assert G._tuned_table("GPU X")[("linear", 2, 2560, 9728)] is None
        assert S.choose_config("linear", 4, 2560, 9728, cuda) == S.SkinnyConfig(8, 256, 2, 1)  # other rows kept
        assert S.choose_config("add_rms_norm_linear", 2, 6144, 2560, cuda) is None  # the norm left to its kernel
        assert S.choose_config("linear", 2, 6144, 2560, cuda) == plain
    finally:
        for module in (S, G):
            module._tuned_table.cache_clear()
    written = [e for e in tuned_table.entries(skinny_path, "GPU X") if e["m"] == 2]
    assert {e["replay_ms"] for e in written} == {3.1, 3.2, 3.3, 3.4}


class _Landscape:
    """A synthetic replay: each linear's config adds its cost; `lucky` scores low on its first trial only (the noise
    a single score can carry). Records the trials it was asked for."""

    def __init__(self, costs: dict[str, dict[str, float]], lucky: set[str] = frozenset()) -> None:
        self.costs, self.lucky, self.trials = costs, set(lucky), []

    def __call__(self, trial: dict[str, str]) -> float:
        self.trials.append(dict(trial))
        total = 2.0 + sum(self.costs[attr][cfg] for attr, cfg in trial.items())
        first_lucky = [cfg for cfg in trial.values() if cfg in self.lucky]
        for cfg in first_lucky:
            self.lucky.discard(cfg)
            total -= 0.1
        return total


def _descend(landscape: _Landscape, confirm: int, min_gain: float = 0.02, rounds: int = 1):
    tries = {attr: sorted(costs) for attr, costs in landscape.costs.items()}
    chosen = {attr: "a" for attr in landscape.costs}
    scores, changed = tune.descend({attr: (1, 2, 3) for attr in landscape.costs}, tries, chosen, landscape, rounds,
                                   confirm, min_gain, [])
    return chosen, scores, changed


def test_descent_takes_a_faster_candidate_after_confirming_it() -> None:
    landscape = _Landscape({"o_proj": {"a": 0.5, "b": 0.3, "c": 0.6}, "qkv_proj": {"a": 0.2, "b": 0.4}})
    chosen, scores, changed = _descend(landscape, confirm=3)
    assert chosen == {"o_proj": "b", "qkv_proj": "a"} and changed == ["o_proj"]
    assert scores == {"o_proj": pytest.approx(2.5), "qkv_proj": pytest.approx(2.5)}  # b + qkv's a; qkv's a + o's b
    # o_proj: the incumbent and 3 candidates, then 3 interleaved pairs; qkv_proj: its incumbent and 2 candidates
    assert len(landscape.trials) == 4 + 6 + 3
    assert [t["o_proj"] for t in landscape.trials[4:10]] == ["a", "b"] * 3


def test_descent_keeps_the_incumbent_against_a_lucky_single_score() -> None:
    """`b` scores 0.1 ms low once: without confirmation it would win; re-scored, it is as fast as `a` and stays out."""
    costs = {"o_proj": {"a": 0.5, "b": 0.5}}
    chosen, _, changed = _descend(_Landscape(costs, lucky={"b"}), confirm=0)
    assert chosen == {"o_proj": "b"} and changed == ["o_proj"]  # the winner's curse, unconfirmed
    chosen, scores, changed = _descend(_Landscape(costs, lucky={"b"}), confirm=3)
    assert chosen == {"o_proj": "a"} and changed == [] and scores == {"o_proj": pytest.approx(2.5)}


def test_descent_needs_more_than_the_minimum_gain() -> None:
    costs = {"o_proj": {"a": 0.5, "b": 0.49}}
    assert _descend(_Landscape(costs), confirm=2, min_gain=0.02)[2] == []
    assert _descend(_Landscape(costs), confirm=2, min_gain=0.005)[2] == ["o_proj"]
