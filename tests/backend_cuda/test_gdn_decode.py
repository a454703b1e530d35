"""The fused decode mixer (`kernels/gdn_decode.py`, `CudaGatedDeltaOps.gated_delta_mix` at decode) against the
chain of the three separate CUDA kernels (the same adapter with `fused_decode=False`) and the CPU adapter's
`gated_delta_mix` (torch ops).

Each case starts all three from the same random conv and recurrent pools (slots shuffled, not all in the batch),
runs two consecutive decode steps and compares the outputs and the whole pools after each, so a write to a slot
outside the batch, or a conv window shifted wrongly, fails."""

from __future__ import annotations

import pytest
import torch

import infer_backend_cuda.gated_delta as cuda_gdn
from infer_backend_cpu.gated_delta import CpuGatedDeltaOps
from infer_backend_cuda.gated_delta import FUSED_DECODE_ENV, CudaGatedDeltaOps, fused_decode_wanted
from infer_core.ports.linear_attention import GdnLayer, StateBatch, unfused_gated_delta_mix
from tests.backend_cuda.conftest import HAS_CUDA, gpu


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(lens: list[int], slots: list[int], device: str) -> StateBatch:
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return StateBatch(cu, torch.tensor(slots, dtype=torch.int32, device=device), max(lens),
                      all(n == 1 for n in lens))


def _layer(hk: int, hv: int, dk: int, dv: int, kw: int, dtype: torch.dtype, device: str, seed: int) -> GdnLayer:
    gen = _gen(seed)
    conv_dim = 2 * hk * dk + hv * dv

    def rand(shape, scale: float, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale + shift).to(dtype=dtype, device=device)

    # dt_bias spread so that a + dt_bias meets softplus's linear, log1p and exp regimes.
    return GdnLayer(hk, dk, hv, dv, rand((conv_dim, kw), 0.5), rand((hv,), 0.5), rand((hv,), 8.0),
                    rand((dv,), 0.2, 1.0), 1e-6)


def _pools(layer: GdnLayer, kw: int, num_slots: int, dtype: torch.dtype, device: str, seed: int):
    gen = _gen(seed)
    conv_dim = 2 * layer.num_k_heads * layer.k_head_dim + layer.num_v_heads * layer.v_head_dim
    conv = torch.randn((num_slots, conv_dim, kw - 1), generator=gen).to(dtype=dtype, device=device)
    rec = (torch.randn((num_slots, layer.num_v_heads, layer.k_head_dim, layer.v_head_dim), generator=gen)
           * 0.5).to(device)
    return conv, rec


def _projected(rows: int, layer: GdnLayer, dtype: torch.dtype, device: str, seed: int):
    """qkv, z, b, a as the model passes them: row-strided views of one fused in_proj output."""
    hk, dk, hv, dv = layer.num_k_heads, layer.k_head_dim, layer.num_v_heads, layer.v_head_dim
    sizes = (2 * hk * dk + hv * dv, hv * dv, hv, hv)
    projected = torch.randn((rows, sum(sizes)), generator=_gen(seed))
    projected[:, -hv:] *= 6  # a
    return projected.to(dtype=dtype, device=device).split(sizes, dim=-1)


def _run(ops, layer, pools, step_inputs, batch):
    conv, rec = pools
    return ops.gated_delta_mix(*step_inputs, layer, conv, rec, batch)


def _compare(lens_slots, shape, kw, dtype, device, seed, skip_scratch=False, ops=None):
    """Two decode steps (the second with the slots in another order) through the fused kernel, the unfused chain
    and the CPU adapter, from the same pools; returns nothing, asserts every step."""
    hk, hv, dk, dv = shape
    layer = _layer(hk, hv, dk, dv, kw, dtype, device, seed)
    num_slots = max(max(s) for s in lens_slots) + 2
    start = _pools(layer, kw, num_slots, dtype, device, seed + 1)
    ways = {"fused": ops or CudaGatedDeltaOps(device, fused_decode=True), "unfused": CudaGatedDeltaOps(device, False),
            "cpu": CpuGatedDeltaOps(device)}
    pools = {name: (start[0].clone(), start[1].clone()) for name in ways}
    loose = dtype != torch.float32
    for step, slots in enumerate(lens_slots):
        batch = _batch([1] * len(slots), slots, device)
        inputs = _projected(len(slots), layer, dtype, device, seed + 10 + step)
        outs = {name: _run(ops, layer, pools[name], inputs, batch) for name, ops in ways.items()}
        fused = outs["fused"]
        assert fused.dtype == dtype and fused.shape == (len(slots), hv * dv)
        real_rows = [i for i, s in enumerate(slots) if not (skip_scratch and s == 0)]
        real_slots = slice(1, None) if skip_scratch else slice(None)
        for other in ("unfused", "cpu"):
            # bf16: the same rounding steps, but an intermediate may round the other way (a one-ulp flip); against
            # the CPU the interpreter's fp32 -> bf16 truncation too. fp32: summation order only.
            out_tol = dict(atol=3e-2, rtol=3e-2) if loose else dict(atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(fused[real_rows].float().cpu(), outs[other][real_rows].float().cpu(),
                                       **out_tol, msg=lambda m: f"step {step}, output vs {other}: {m}")
            if loose and other == "unfused":
                # The same roundings of the same values: equal but for the rare flip that a different fp32
                # summation order causes; a rounding step left out (or added) flips a large share.
                same = (fused[real_rows] == outs[other][real_rows]).float().mean().item()
                assert same >= 0.99, f"step {step}: only {same:.1%} of the outputs equal the unfused chain's"
            # Conv states are copies of inputs: equal. Recurrent states: fp32 rounding apart, given the same
            # rounded q, k, v (the unfused chain's); the CPU's bf16 conv output rounds to nearest.
            conv, rec = pools["fused"]
            torch.testing.assert_close(conv[real_slots].cpu(), pools[other][0][real_slots].cpu(), atol=0, rtol=0)
            rec_tol = dict(atol=2e-2, rtol=2e-2) if loose and other == "cpu" else dict(atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(rec[real_slots].cpu(), pools[other][1][real_slots].cpu(), **rec_tol,
                                       msg=lambda m: f"step {step}, recurrent states vs {other}: {m}")
        untouched = [s for s in range(num_slots) if s not in slots and s not in (lens_slots[0] if step else [])]
        for s in untouched:
            assert torch.equal(pools["fused"][0][s], start[0][s]) and torch.equal(pools["fused"][1][s], start[1][s])


SMALL = [(1, 1, 16, 16), (2, 4, 16, 16), (1, 2, 32, 32), (2, 2, 32, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SMALL, ids=["group1", "group2", "group2-d32", "group1-dk32-dv16"])
def test_fused_decode_equals_unfused_chain_and_cpu(shape, dtype, device):
    """Batches of 3 then 3 in another order (slots not sorted, one slot left out between the steps), conv K=4."""
    _compare([[5, 2, 7], [7, 5, 2]], shape, 4, dtype, device, seed=1)


@pytest.mark.parametrize("batch", [[[3]], [[4, 1, 6, 2, 5], [2, 6, 3, 4, 1]]], ids=["batch1", "batch5"])
def test_fused_decode_batch_sizes(batch, device):
    _compare(batch, (2, 4, 16, 32), 4, torch.float32, device, seed=2)


@pytest.mark.parametrize("kw", [2, 3, 5])
def test_fused_decode_conv_kernels(kw, device):
    """Conv widths 2 (a 1-column state), 3 and 5 (a state of K - 1 columns padded to a power of two)."""
    _compare([[2, 4], [4, 1]], (1, 2, 16, 16), kw, torch.float32, device, seed=3)


@pytest.mark.parametrize("block_v", [4, 8])
def test_fused_decode_value_blocks_of_a_group_arrive_in_any_order(block_v, device):
    """Several value blocks a head (2-4) and 2 heads a key head: the program that arrives last (any of them under
    the interpreter's order, or a real GPU's) shifts the shared q / k conv state and normalises the whole heads;
    the counters are left zero for the next launch (the second step reuses them)."""
    ops = CudaGatedDeltaOps(device, fused_decode=True)
    real = cuda_gdn.gdn_decode

    def with_block(*args, **kwargs):
        return real(*args, **kwargs, block_v=block_v)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_gdn, "gdn_decode", with_block)
        _compare([[5, 2, 7], [7, 5, 2]], (2, 4, 16, 16), 4, torch.bfloat16, device, seed=11, ops=ops)
    assert ops._arrivals.count_nonzero().item() == 0


def test_fused_decode_head_dims_not_powers_of_two(device):
    _compare([[3, 1], [1, 3]], (1, 3, 12, 20), 4, torch.float32, device, seed=4)


def test_fused_decode_padding_rows(device):
    """A padded graph batch: one padding row on scratch slot 0 is a slot like any (compared too); with two, slot 0
    is raced over (as by the unfused kernels) and only the real rows and slots are compared."""
    _compare([[3, 0, 1], [1, 3, 0]], (2, 4, 16, 16), 4, torch.float32, device, seed=5)
    _compare([[2, 0, 1, 0], [0, 1, 2, 0]], (2, 4, 16, 16), 4, torch.bfloat16, device, seed=6, skip_scratch=True)


def test_env_switch():
    assert fused_decode_wanted({}) and fused_decode_wanted({FUSED_DECODE_ENV: "1"})
    assert not fused_decode_wanted({FUSED_DECODE_ENV: "0"}) and not fused_decode_wanted({FUSED_DECODE_ENV: " 0 "})


@pytest.mark.parametrize("fused, lens, launches", [(True, [1, 1], 1), (False, [1, 1], 0), (True, [3, 1], 0)],
                         ids=["decode-fused", "decode-switched-off", "prefill"])
def test_adapter_runs_the_fused_kernel_only_for_fused_decode(fused, lens, launches, device, monkeypatch):
    """The adapter takes the fused kernel at decode unless switched off, and the unfused chain for any other step
    (its result equals the CPU adapter's there too); a spy counts the real kernel's calls."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    real = cuda_gdn.gdn_decode
    monkeypatch.setattr(cuda_gdn, "gdn_decode", spy)
    layer = _layer(1, 2, 16, 16, 4, torch.float32, device, seed=7)
    cuda_pools = _pools(layer, 4, 4, torch.float32, device, seed=8)
    cpu_pools = tuple(p.clone() for p in cuda_pools)
    batch = _batch(lens, [2, 1], device)
    inputs = _projected(sum(lens), layer, torch.float32, device, seed=9)
    out = _run(CudaGatedDeltaOps(device, fused_decode=fused), layer, cuda_pools, inputs, batch)
    want = _run(CpuGatedDeltaOps(device), layer, cpu_pools, inputs, batch)
    assert len(calls) == launches
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cuda_pools[1].cpu(), cpu_pools[1].cpu(), atol=1e-5, rtol=1e-5)


QWEN35 = (16, 32, 128, 128)  # Hk, Hv, Dk, Dv: 8192 conv channels


@gpu
def test_fused_decode_qwen35_shapes(device):
    slots = [3, 9, 0, 1, 12, 7, 4, 2]
    _compare([slots, slots[::-1]], QWEN35, 4, torch.bfloat16, device, seed=20)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_fused_decode_graph_replay_equals_eager(device):
    """The fused launch captured once and replayed on new inputs copied into the captured buffers: the same output
    and pools as an eager call from the same pools (grid and arguments from shapes only)."""
    layer = _layer(*QWEN35, 4, torch.bfloat16, device, seed=21)
    ops = CudaGatedDeltaOps(device, fused_decode=True)
    start = _pools(layer, 4, 6, torch.bfloat16, device, seed=22)
    batch = _batch([1] * 4, [3, 1, 0, 5], device)
    bufs = _projected(4, layer, torch.bfloat16, device, seed=23)
    pools = tuple(p.clone() for p in start)
    _run(ops, layer, tuple(p.clone() for p in start), bufs, batch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(ops, layer, pools, bufs, batch)
    for seed in (24, 25):
        new = _projected(4, layer, torch.bfloat16, device, seed)
        for buf, x in zip(bufs, new):
            buf.copy_(x)
        for p, s in zip(pools, start):
            p.copy_(s)
        graph.replay()
        eager_pools = tuple(p.clone() for p in start)
        eager = _run(ops, layer, eager_pools, new, batch)
        assert torch.equal(out, eager)
        assert all(torch.equal(p, e) for p, e in zip(pools, eager_pools))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_folds_the_gates_into_the_recurrence_bit_for_bit(dtype, device, monkeypatch):
    """At decode the adapter's three launches (conv, recurrence computing its head's gates, gated norm) give the
    port's four-op chain's output and pools exactly, and the gates kernel does not run; a prefill step keeps it."""
    gates_calls = []
    real_gates = cuda_gdn.gdn_gates

    def spy(*args, **kwargs):
        gates_calls.append(1)
        return real_gates(*args, **kwargs)

    monkeypatch.setattr(cuda_gdn, "gdn_gates", spy)
    layer = _layer(2, 4, 16, 16, 4, dtype, device, seed=30)
    start = _pools(layer, 4, 6, dtype, device, seed=31)
    ops = CudaGatedDeltaOps(device, fused_decode=False)
    folded, chain = tuple(p.clone() for p in start), tuple(p.clone() for p in start)
    for step, slots in enumerate([[4, 1, 3], [3, 4, 1]]):
        batch = _batch([1] * len(slots), slots, device)
        inputs = _projected(len(slots), layer, dtype, device, seed=32 + step)
        out = _run(ops, layer, folded, inputs, batch)
        assert not gates_calls
        want = unfused_gated_delta_mix(ops, *inputs, layer, *chain, batch)
        assert gates_calls == [1]
        gates_calls.clear()
        assert torch.equal(out, want), f"step {step}"
        assert torch.equal(folded[0], chain[0]) and torch.equal(folded[1], chain[1]), f"step {step}"
    prefill = _batch([3, 1], [2, 5], device)
    _run(ops, layer, folded, _projected(4, layer, dtype, device, seed=40), prefill)
    assert gates_calls == [1]
