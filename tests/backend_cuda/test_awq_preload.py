"""The one-row AWQ GEMV asking for its first group's weights before `gdc_wait` (`awq_gemv._one_row_preloaded`,
`INFER_CUDA_AWQ_PRELOAD`, default on) must give the after-the-wait path's output bit for bit: one, two and three
groups a program (the group-ahead loads, a last split shorter than the others), a partial column tile, both sums,
bias on and off; rows as one-row programs. Interpreter shapes are tiny; the Qwen3-4B shapes with PDL and a graph
replay are marked `gpu`."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda.kernels import awq_gemm as A, awq_gemv as AV, split_k
from tests.backend_cuda.conftest import gpu, needs_cuda, poison
from tests.backend_cuda.quant_operands import QWEN3_4B, activations, awq_operands
from tests.worker.quant_checkpoints import quantize_awq

# (K, group, k_splits): 8 groups in 8 / 4 / 3 ranges (1, 2 and 3-3-2 groups a program); 4 groups in one range
CASES = [(512, 64, 8), (512, 64, 4), (512, 64, 3), (256, 64, 1)]


def _run(x, operands, bias, config, preload: bool, monkeypatch) -> torch.Tensor:  # noqa: ANN001
    monkeypatch.setattr(AV, "PRELOAD", preload)
    out = poison(torch.empty((x.shape[0], operands[2].shape[1]), dtype=x.dtype, device=x.device))
    return A.awq_linear(x, *operands, bias, out=out, config=config)


@pytest.mark.parametrize("fixup", [True, False])
@pytest.mark.parametrize("k,group,k_splits", CASES)
def test_preloaded_one_row_gemv_equals_the_after_wait_path_bit_for_bit(k, group, k_splits, fixup, device,
                                                                        monkeypatch):
    n = 72  # a partial last column tile of 32
    tensors, dense = quantize_awq(torch.randn(n, k, generator=torch.Generator().manual_seed(k_splits)) * 0.05, group)
    operands = [tensors[name].to(device) for name in ("qweight", "qzeros", "scales")]
    bias = activations(n, 1, torch.float32, device, 7).reshape(n) if fixup else None
    x = activations(1, k, torch.float32, device, seed=3)
    monkeypatch.setattr(split_k, "FIXUP_OVERRIDE", fixup)
    config = A.AwqConfig(1, 32, 16, 2, 1, k_splits)
    after = _run(x, operands, bias, config, False, monkeypatch)
    preloaded = _run(x, operands, bias, config, True, monkeypatch)
    assert torch.equal(preloaded, after)
    expected = x @ dense.to(device).t() + (bias if bias is not None else 0)
    torch.testing.assert_close(preloaded, expected, atol=2e-4, rtol=2e-4)


def test_row_programs_preload_each_row_bit_for_bit(device, monkeypatch):
    """Three rows as one-row programs of their own (`AwqConfig.row_programs`, each program's x offset to its row):
    preloaded == after-wait bit for bit, close to the dense twin."""
    n, k, group = 72, 512, 64
    tensors, dense = quantize_awq(torch.randn(n, k, generator=torch.Generator().manual_seed(11)) * 0.05, group)
    operands = [tensors[name].to(device) for name in ("qweight", "qzeros", "scales")]
    x = activations(3, k, torch.float32, device, seed=4)
    config = A.AwqConfig(4, 32, 16, 2, 1, 4, True)
    after = _run(x, operands, None, config, False, monkeypatch)
    preloaded = _run(x, operands, None, config, True, monkeypatch)
    assert torch.equal(preloaded, after)
    torch.testing.assert_close(preloaded, x @ dense.to(device).t(), atol=2e-4, rtol=2e-4)


def test_preload_only_where_its_registers_fit(monkeypatch):
    """One-row programs of 16 accumulator elements a thread or fewer: the H100's default one-row config (128 columns,
    8-row K steps, 2 warps) and the H200 table's qkv / down (64, 8, 1 warp); not its gate / up (128, 16, 2 warps:
    255 registers with the preload), not the multi-row GEMV, not with the switch off."""
    monkeypatch.setattr(AV, "PRELOAD", True)
    assert A.gemv_config(1, 6144, 2560, 128)[1:4] == (128, 8, 2)  # the default this test's first case stands for
    assert AV.preloads(1, False, 8, 128, 2) and AV.preloads(1, False, 8, 64, 1) and AV.preloads(3, True, 8, 128, 2)
    assert not AV.preloads(1, False, 16, 128, 2)
    assert not AV.preloads(2, False, 8, 128, 2)
    monkeypatch.setattr(AV, "PRELOAD", False)
    assert not AV.preloads(1, False, 8, 128, 2)


@pytest.mark.parametrize(("raw", "expected"), [(None, True), ("", True), (" 1 ", True), ("0", False)])
def test_preload_switch_parses(raw, expected) -> None:  # noqa: ANN001
    environ = {} if raw is None else {AV.PRELOAD_ENV: raw}
    assert AV.preload_switch(environ) is expected


@pytest.mark.parametrize("raw", ["yes", "2", "on"])
def test_preload_switch_refuses_other_values(raw) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=AV.PRELOAD_ENV):
        AV.preload_switch({AV.PRELOAD_ENV: raw})


@pytest.mark.parametrize(("raw", "expected"),
                         [(None, {}), (" ", {}), ("128", {"maxnreg": 128}), ("255", {"maxnreg": 255})])
def test_register_cap_switch_parses(raw, expected) -> None:  # noqa: ANN001
    environ = {} if raw is None else {AV.MAXNREG_ENV: raw}
    assert AV.maxnreg_switch(environ) == expected


@pytest.mark.parametrize("raw", ["0", "23", "256", "many", "-128"])
def test_register_cap_switch_refuses_other_values(raw) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=AV.MAXNREG_ENV):
        AV.maxnreg_switch({AV.MAXNREG_ENV: raw})


@gpu
@needs_cuda
@pytest.mark.parametrize("maxnreg", [{}, {"maxnreg": 128}])
def test_preloaded_gemv_on_gpu_equals_the_after_wait_path_and_replays_in_a_graph(maxnreg, monkeypatch):
    """Qwen3-4B's four shapes at one row in bf16 (each its default config, PDL on a Hopper GPU): same bits either
    way; then the four chained in one CUDA graph (each GEMV's preload overlapping the one before), replayed on new
    inputs, equal to eager calls of the after-wait path."""
    monkeypatch.setattr(AV, "MAXNREG", maxnreg)  # the register cap of INFER_CUDA_AWQ_GEMV_MAXNREG, off and on
    weights = [awq_operands(n, k, 128, "cuda", seed=n) for n, k in QWEN3_4B]
    xs = [activations(1, k, torch.bfloat16, "cuda", seed=k) for _, k in QWEN3_4B]
    for x, operands in zip(xs, weights):
        after = _run(x, operands, None, None, False, monkeypatch)
        assert torch.equal(_run(x, operands, None, None, True, monkeypatch), after)

    monkeypatch.setattr(AV, "PRELOAD", True)
    split_k.allocate_counters(torch.device("cuda"))

    def chain() -> list[torch.Tensor]:
        return [A.awq_linear(x, *operands, None) for x, operands in zip(xs, weights)]

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for seed in (5, 6):
        for x in xs:
            x.copy_(activations(1, x.shape[1], torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        monkeypatch.setattr(AV, "PRELOAD", False)
        expected = chain()
        monkeypatch.setattr(AV, "PRELOAD", True)
        torch.cuda.synchronize()
        assert all(torch.equal(c, e) for c, e in zip(captured, expected))
