"""The Gated DeltaNet kernels (`CudaGatedDeltaOps`) against plain-torch references written here: the gated
delta rule as its per-token recurrence, the causal conv1d through `F.conv1d`.

Batches are ragged and start from random (non-zero) states in shuffled slots; whole pools are compared, so a
write to a slot outside the batch fails."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda.gated_delta import SHORT_ROW, CudaGatedDeltaOps
from infer_backend_cuda.kernels.gdn_chunk import gdn_chunk
from infer_backend_cuda.kernels.gdn_recurrent import gdn_recurrent
from infer_core.ports.linear_attention import StateBatch
from tests.backend_cuda.conftest import HAS_CUDA, gpu

QWEN35 = dict(hk=16, hv=32, dk=128, dv=128)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(lens: list[int], slots: list[int], device) -> StateBatch:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return StateBatch(
        cu_seqlens=cu.to(device), slot_ids=torch.tensor(slots, dtype=torch.int32, device=device),
        max_query_len=max(lens), is_decode=all(n == 1 for n in lens),
    )


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def ref_gated_delta_rule(q, k, v, g, beta, states, lens, slots):
    """Per sequence, per token: S = S * exp(g); S += k (beta (v - k^T S))^T; o = q^T S (fp32, on the CPU).
    Returns (o, new states)."""
    hk, dk = q.shape[1], q.shape[2]
    hv = v.shape[1]
    rep = hv // hk
    qf = _l2(q.float().cpu()).repeat_interleave(rep, dim=1) * dk**-0.5
    kf = _l2(k.float().cpu()).repeat_interleave(rep, dim=1)
    vf, gf, bf = v.float().cpu(), g.float().cpu(), beta.float().cpu()
    new = states.detach().float().cpu().clone()
    out = torch.zeros(vf.shape)
    t = 0
    for n, slot in zip(lens, slots):
        s = new[slot].clone()  # [Hv, Dk, Dv]
        for _ in range(n):
            s = s * gf[t].exp()[:, None, None]
            kv = torch.einsum("hk,hkv->hv", kf[t], s)
            delta = (vf[t] - kv) * bf[t][:, None]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", qf[t], s)
            t += 1
        new[slot] = s
    return out, new


def _gdn_inputs(lens, hk, hv, dk, dv, dtype, device, seed, decay=None):
    """`decay`: per-token log decays uniform over (-decay, 0] instead of the default spread."""
    gen = _gen(seed)
    t = sum(lens)
    q = torch.randn((t, hk, dk), generator=gen).to(dtype)
    k = torch.randn((t, hk, dk), generator=gen).to(dtype)
    v = torch.randn((t, hv, dv), generator=gen).to(dtype)
    # Decays spread from ~1 (no forgetting) to ~e^-4 per token, betas over (0, 1).
    g = -torch.rand((t, hv), generator=gen) * 4 * torch.rand((1, hv), generator=gen)
    beta = torch.rand((t, hv), generator=gen)
    if decay is not None:
        g = -torch.rand((t, hv), generator=gen) * decay
    return [x.to(device) for x in (q, k, v, g, beta)]


def _check_gdn(lens, shape, dtype, device, seed=0, decay=None, state_tol=None):
    hk, hv, dk, dv = shape["hk"], shape["hv"], shape["dk"], shape["dv"]
    ops = CudaGatedDeltaOps(device)
    num_slots = len(lens) + 3
    (_, states), = ops.allocate_state_pools(1, num_slots, 8, 4, hv, dk, dv, torch.float32)
    states.copy_(torch.randn(states.shape, generator=_gen(seed + 1)) * 0.5)
    slots = torch.randperm(num_slots - 1, generator=_gen(seed + 2))[: len(lens)].add(1).tolist()
    q, k, v, g, beta = _gdn_inputs(lens, hk, hv, dk, dv, dtype, device, seed, decay)
    ref_o, ref_states = ref_gated_delta_rule(q, k, v, g, beta, states, lens, slots)
    batch = _batch(lens, slots, device)
    o = ops.gated_delta_rule(q, k, v, g, beta, states, batch)
    assert o.dtype == dtype and o.shape == v.shape
    # bf16 inputs feed both sides as the same values; only the output's final rounding to bf16 differs.
    o_tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(o.float().cpu(), ref_o, **o_tol)
    torch.testing.assert_close(states.cpu(), ref_states, **(state_tol or dict(atol=1e-3, rtol=2e-4)))


TINY = dict(hk=2, hv=4, dk=16, dv=8)


def test_allocate_and_reset_slots(device):
    ops = CudaGatedDeltaOps(device)
    pools = ops.allocate_state_pools(2, 5, 6, 4, 3, 8, 4, torch.bfloat16)
    assert len(pools) == 2
    for conv, rec in pools:
        assert conv.shape == (5, 6, 3) and conv.dtype == torch.bfloat16
        assert rec.shape == (5, 3, 8, 4) and rec.dtype == torch.float32
        assert not conv.any() and not rec.any()
        conv.fill_(1)
        rec.fill_(2)
    ops.reset_slots(pools, torch.tensor([3, 0], dtype=torch.int32, device=device))
    for conv, rec in pools:
        for slot in range(5):
            cleared = slot in (0, 3)
            assert bool((conv[slot] == 0).all()) == cleared and bool((rec[slot] == 0).all()) == cleared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_decode_step(dtype, device):
    """A decode step (every sequence one token, GQA 2), from non-zero states; other slots stay as they were."""
    _check_gdn([1, 1, 1], TINY, dtype, device)


def test_recurrent_decode_non_pow2_heads(device):
    """Head dims no power of two; two value blocks per head (the second partly masked); GQA 3."""
    _check_gdn([1, 1], dict(hk=1, hv=3, dk=60, dv=80), torch.float32, device, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_ragged(dtype, device):
    """Sequences longer than a chunk (a partial last chunk), exactly one chunk, a 1-token row (mixed step), an
    empty row (its state stays) and a short one; GQA 2, from non-zero states."""
    _check_gdn([70, 1, 0, 64, 5], dict(hk=1, hv=2, dk=16, dv=16), dtype, device, seed=2)


def test_chunked_prefill_odd_head_dims(device):
    """Key head dim below the 16-wide dot tile, value head dim over two 32-column blocks, neither a power of
    two; GQA 3."""
    _check_gdn([9, 66], dict(hk=1, hv=3, dk=12, dv=40), torch.float32, device, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decay", [1e-3, 8.0], ids=["decay-near-1", "decay-near-0"])
def test_chunked_prefill_long_rows_extreme_decays(decay, dtype, device):
    """Rows of several chunks (one partial) from non-zero states, per-token decays ~1 (no forgetting: the state
    carries every chunk's rounding on) or down to e^-8 (the in-chunk decay products underflow). bf16 rows take
    the bf16 dots and the three-term bf16 split of T; the state tolerance (~fp32 rounding over the rows) fails
    with T rounded to a single bf16 term (1.8e-3 off)."""
    _check_gdn([300, 130], dict(hk=1, hv=2, dk=32, dv=32), dtype, device, seed=12, decay=decay,
               state_tol=dict(atol=5e-5, rtol=5e-5))


def test_chunked_prefill_near_identical_keys(device):
    """Near-identical keys with beta ~ 1 and no decay: the worst case for the in-chunk triangular inverse (the
    powers of M grow combinatorially here, so only a stable solve matches the recurrence)."""
    ops = CudaGatedDeltaOps(device)
    lens, hk, hv, dk, dv = [100], 1, 1, 16, 16
    (_, states), = ops.allocate_state_pools(1, 2, 8, 4, hv, dk, dv, torch.float32)
    q, k, v, g, beta = _gdn_inputs(lens, hk, hv, dk, dv, torch.float32, device, 30)
    k = k[:1] + 1e-2 * k  # every key ~ the first one
    g, beta = torch.zeros_like(g), torch.full_like(beta, 0.999)
    ref_o, ref_states = ref_gated_delta_rule(q, k, v, g, beta, states, lens, [1])
    o = ops.gated_delta_rule(q, k, v, g, beta, states, _batch(lens, [1], device))
    torch.testing.assert_close(o.cpu(), ref_o, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(states.cpu(), ref_states, atol=2e-3, rtol=2e-3)


# A mixed step: decode rows, rows just below / at / above the recurrent-vs-chunked threshold, rows with a partial
# last chunk, an empty one. Under TRITON_INTERPRET=1 every tl.dot is computed in fp32 whatever its
# input_precision, so these tolerances are those of fp32 rounding; on the GPU the same test checks the tensor-core
# precisions (tf32x3; for bf16 rows bf16 and bf16x3 dots, TF32 output products).
MIXED = [1, 40, 1, SHORT_ROW - 1, SHORT_ROW, SHORT_ROW + 1, 1, 130, 0, 3, 64, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_splits_rows_between_the_kernels(dtype, device):
    """A ragged mixed batch through `gated_delta_rule` (short rows recurrent, the rest chunked, one step) equals
    the per-token recurrence, outputs and every slot of the pool."""
    _check_gdn(MIXED, dict(hk=1, hv=2, dk=16, dv=16), dtype, device, seed=8)


def _routing_case(device, seed):
    lens, hk, hv, dk, dv = MIXED, 1, 2, 16, 16
    num_slots = len(lens) + 2
    gen = _gen(seed)
    states = torch.randn((num_slots, hv, dk, dv), generator=gen).to(device) * 0.5
    slots = torch.randperm(num_slots - 1, generator=gen)[: len(lens)].add(1).tolist()
    q, k, v, g, beta = _gdn_inputs(lens, hk, hv, dk, dv, torch.float32, device, seed)
    ref_o, ref_states = ref_gated_delta_rule(q, k, v, g, beta, states, lens, slots)
    batch = _batch(lens, slots, device)
    out = torch.full(v.shape, float("nan"), device=device)
    return lens, slots, states, (q, k, v, g, beta), ref_o, ref_states, batch, out


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_each_kernel_runs_only_its_rows(kernel, device):
    """`gdn_recurrent(max_len=SHORT_ROW - 1)` and `gdn_chunk(min_len=SHORT_ROW)` each write exactly their rows'
    outputs and slots (the others stay NaN / as they were), and those equal the reference."""
    lens, slots, states, args, ref_o, ref_states, batch, out = _routing_case(device, 9)
    start = states.clone()
    if kernel == "recurrent":
        gdn_recurrent(*args, states, batch.cu_seqlens, batch.slot_ids, out, max_len=SHORT_ROW - 1)
    else:
        gdn_chunk(*args, states, batch.cu_seqlens, batch.slot_ids, out, min_len=SHORT_ROW)
    t = 0
    for n, slot in zip(lens, slots):
        mine = (n < SHORT_ROW) == (kernel == "recurrent")
        rows = slice(t, t + n)
        if mine:
            torch.testing.assert_close(out[rows].cpu(), ref_o[rows], atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(states[slot].cpu(), ref_states[slot], atol=1e-3, rtol=2e-4)
        else:
            assert bool(out[rows].isnan().all()), f"row of {n} tokens written by the {kernel} kernel"
            assert torch.equal(states[slot], start[slot]), f"slot of a {n}-token row changed by the {kernel} kernel"
        t += n


@pytest.mark.parametrize("shape", [dict(hk=1, hv=2, dk=16, dv=16), dict(hk=1, hv=3, dk=12, dv=40)],
                         ids=["pow2-dims", "padded-dims"])
def test_chunked_reads_only_scratch_it_wrote(shape, device, monkeypatch):
    """The sequential pass loads its scratch tiles without masks (padded sections, partial chunks' rows past the
    end re-read the last row): with every new buffer NaN-filled, a read of anything the chunk-local pass did not
    write would turn the outputs or states NaN."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    _check_gdn([40, 1, SHORT_ROW, 130, 66], shape, torch.float32, device, seed=10)


@gpu
def test_chunked_prefill_qwen35_shapes(device):
    _check_gdn([700, 1, 64, 129], QWEN35, torch.bfloat16, device, seed=6)


@gpu
def test_recurrent_decode_qwen35_shapes(device):
    _check_gdn([1] * 8, QWEN35, torch.bfloat16, device, seed=5)


def ref_causal_conv1d(x, weight, states, lens, slots):
    """F.conv1d (depthwise, fp32) over each sequence's state followed by its new rows, then SiLU.
    Returns (out, new states)."""
    c, kw = weight.shape
    xf, wf = x.float().cpu(), weight.float().cpu()
    new = states.detach().cpu().clone()
    out = torch.zeros(xf.shape)
    t = 0
    for n, slot in zip(lens, slots):
        if n == 0:  # no new input: the state stays
            continue
        seq = torch.cat([new[slot].float(), xf[t : t + n].T], dim=1)  # [C, K - 1 + n]
        y = torch.nn.functional.conv1d(seq[None], wf[:, None, :], groups=c)[0]  # [C, n]
        out[t : t + n] = torch.nn.functional.silu(y).T
        new[slot] = seq[:, -(kw - 1) :].to(new.dtype)
        t += n
    return out, new


def _check_conv(lens, c, kw, dtype, device, seed=0):
    ops = CudaGatedDeltaOps(device)
    num_slots = len(lens) + 2
    (conv_states, _), = ops.allocate_state_pools(1, num_slots, c, kw, 1, 1, 1, dtype)
    gen = _gen(seed)
    conv_states.copy_(torch.randn(conv_states.shape, generator=gen))
    slots = torch.randperm(num_slots - 1, generator=gen)[: len(lens)].add(1).tolist()
    x = torch.randn((sum(lens), c), generator=gen).to(dtype=dtype, device=device)
    weight = (torch.randn((c, kw), generator=gen) * 0.5).to(device)
    ref_out, ref_states = ref_causal_conv1d(x, weight, conv_states, lens, slots)
    out = ops.causal_conv1d(x, weight, conv_states, _batch(lens, slots, device))
    assert out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float().cpu(), ref_out, **tol)
    torch.testing.assert_close(conv_states.cpu(), ref_states, atol=0, rtol=0)  # state entries are copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_prefill_ragged(dtype, device):
    """Sequences shorter than the kernel window (state and new rows mix in the new state), exactly K - 1 long,
    longer than one token block, and empty (its state stays); channels not a multiple of the channel block."""
    _check_conv([2, 3, 70, 0, 1, 5, 0], 40, 4, dtype, device)


def test_causal_conv1d_update_step(device):
    """The 1-token state update: the state shifts by one."""
    _check_conv([1, 1, 1, 1], 24, 4, torch.float32, device, seed=3)


@gpu
def test_causal_conv1d_qwen35_shapes(device):
    _check_conv([300, 1, 17, 64], 8192, 4, torch.bfloat16, device, seed=4)
    _check_conv([1] * 16, 8192, 4, torch.bfloat16, device, seed=5)


def ref_gated_rms_norm(x, gate, weight, eps):
    """transformers' Qwen3_5RMSNormGated."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * torch.nn.functional.silu(gate.float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 16), (3, 7, 24)] + [pytest.param((513 * 32, 128), marks=gpu)])
def test_gated_rms_norm(shape, dtype, device):
    gen = _gen(11)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype=dtype, device=device)
    gate = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    weight = (torch.rand(shape[-1:], generator=gen) + 0.5).to(dtype=dtype, device=device)
    y = CudaGatedDeltaOps(device).gated_rms_norm(x, gate, weight, 1e-6)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float(), ref_gated_rms_norm(x, gate, weight, 1e-6).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, h", [(7, 4), (3, 6)] + [pytest.param(4096, 32, marks=gpu)])
def test_gdn_gates(t, h, dtype, device):
    """From a fused [a | b] projection output (row-strided views); a + dt_bias spans softplus's linear, log1p
    and exp regimes."""
    gen = _gen(12)
    ab = (torch.randn((t, 2 * h), generator=gen) * 12).to(dtype=dtype, device=device)
    a, b = ab[:, :h], ab[:, h:]
    a_log = torch.randn(h, generator=gen).to(device)
    dt_bias = (torch.randn(h, generator=gen) * 10).to(dtype=dtype, device=device)
    g, beta = CudaGatedDeltaOps(device).gdn_gates(a, b, a_log, dt_bias)
    ref_g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    ref_beta = b.sigmoid().float()
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g, ref_g, atol=1e-5, rtol=1e-5)
    # bf16: up to one ulp (2^-8 below 1) apart, from the exp's rounding and, under the interpreter, the fp32 ->
    # bf16 truncation.
    torch.testing.assert_close(beta, ref_beta, atol=4e-3 if dtype == torch.bfloat16 else 1e-6, rtol=0)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_gdn_decode_step_graph_replay_equals_eager(device):
    """A whole Qwen3.5-4B GDN decode step (gates, conv + state update, recurrence, gated norm), captured once
    and replayed on new inputs copied into the captured buffers: the same outputs and states as eager calls
    from the same states (no host sync or data-dependent allocation inside). Slot 0 is a padding row."""
    ops = CudaGatedDeltaOps(device)
    hk, hv, dk, dv = QWEN35.values()
    conv_dim, n = 2 * hk * dk + hv * dv, 4
    batch = _batch([1] * n, [3, 1, 0, 2], device)
    (conv, rec), = ops.allocate_state_pools(1, 5, conv_dim, 4, hv, dk, dv, torch.bfloat16)
    gen = _gen(20)
    conv.copy_(torch.randn(conv.shape, generator=gen))
    rec.copy_(torch.randn(rec.shape, generator=gen) * 0.1)
    params = [(torch.randn(shape, generator=gen) * 0.3).to(dtype=dtype, device=device) for shape, dtype in (
        ((conv_dim, 4), torch.bfloat16), ((hv,), torch.float32), ((hv,), torch.bfloat16), ((dv,), torch.bfloat16))]
    conv_w, a_log, dt_bias, norm_w = params

    def inputs(seed):
        g = _gen(seed)
        return [torch.randn(shape, generator=g).to(dtype=torch.bfloat16, device=device)
                for shape in ((n, conv_dim), (n, hv), (n, hv), (n, hv * dv))]

    def step(mixed, a, b, z, conv_states, rec_states):
        g, beta = ops.gdn_gates(a, b, a_log, dt_bias)
        x = ops.causal_conv1d(mixed, conv_w, conv_states, batch)
        q = x[:, : hk * dk].view(n, hk, dk)
        k = x[:, hk * dk : 2 * hk * dk].view(n, hk, dk)
        v = x[:, 2 * hk * dk :].view(n, hv, dv)
        o = ops.gated_delta_rule(q, k, v, g, beta, rec_states, batch)
        return ops.gated_rms_norm(o.view(-1, dv), z.view(-1, dv), norm_w, 1e-6)

    start = (conv.clone(), rec.clone())
    bufs = inputs(21)
    step(*bufs, conv.clone(), rec.clone())  # warm-up (compiles) on copies of the states
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*bufs, conv, rec)
    for seed in (22, 23):
        new = inputs(seed)
        for buf, x in zip(bufs, new):
            buf.copy_(x)
        conv.copy_(start[0])
        rec.copy_(start[1])
        out.fill_(float("nan"))
        graph.replay()
        eager_conv, eager_rec = start[0].clone(), start[1].clone()
        eager = step(*new, eager_conv, eager_rec)
        assert torch.equal(out, eager)
        assert torch.equal(conv, eager_conv) and torch.equal(rec, eager_rec)
        assert not torch.equal(rec[1:], start[1][1:]) and not torch.equal(conv[1:], start[0][1:])
