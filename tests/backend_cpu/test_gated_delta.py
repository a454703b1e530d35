"""The CPU Gated DeltaNet ops against transformers' torch fallbacks (the oracle), on random ragged batches with
initial states and prompts across chunk boundaries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from infer_backend_cpu import CpuBackend
from infer_backend_cpu.gated_delta import CHUNK
from infer_core.ports.linear_attention import StateBatch

GDN = CpuBackend(device="cpu").ops.gdn
assert GDN is not None
HK, HV, DK, DV = 2, 4, 8, 16
CONV_DIM, KERNEL = 12, 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(lengths: list[int], slots: list[int]) -> StateBatch:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return StateBatch(cu, torch.tensor(slots, dtype=torch.int32), max(lengths), all(n == 1 for n in lengths))


def _inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = _gen(seed)
    q = torch.randn(total, HK, DK, generator=g)
    k = torch.randn(total, HK, DK, generator=g)
    v = torch.randn(total, HV, DV, generator=g)
    gate = -F.softplus(torch.randn(total, HV, generator=g))  # log decay <= 0
    beta = torch.rand(total, HV, generator=g)
    return q, k, v, gate, beta


def _states(num_slots: int, seed: int) -> torch.Tensor:
    return torch.randn(num_slots, HV, DK, DV, generator=_gen(seed)) * 0.5


def _oracle(fn, q, k, v, g, beta, state):  # one sequence through transformers: [1, L, ...] tensors
    out, final = fn(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None].clone(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


@pytest.mark.parametrize("oracle", [hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule])
def test_ragged_prefill_from_slot_states_matches_transformers(oracle) -> None:
    lengths, slots = [5, CHUNK, 2 * CHUNK + 3, 1, 17], [3, 1, 5, 2, 4]
    q, k, v, g, beta = _inputs(sum(lengths), seed=0)
    states = _states(6, seed=1)
    before = states.clone()
    out = GDN.gated_delta_rule(q, k, v, g, beta, states, _batch(lengths, slots))
    start = 0
    for n, slot in zip(lengths, slots):
        rows = slice(start, start + n)
        want, final = _oracle(oracle, q[rows], k[rows], v[rows], g[rows], beta[rows], before[slot])
        torch.testing.assert_close(out[rows], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states[slot], final, rtol=1e-4, atol=1e-4)
        start += n
    torch.testing.assert_close(states[0], before[0], rtol=0, atol=0)  # a slot nobody named is untouched


def test_decode_steps_and_split_prefill_continue_the_same_recurrence() -> None:
    """A prompt computed as two chunks (cut mid-chunk) and then decoded token by token gives the outputs and
    state of one pass over it all."""
    total, cut = CHUNK + 40, CHUNK - 10
    q, k, v, g, beta = _inputs(total + 3, seed=2)
    state0 = _states(1, seed=3)[0]
    states = torch.zeros(4, HV, DK, DV)
    states[2] = state0
    parts = [GDN.gated_delta_rule(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], states, _batch([cut], [2])),
             GDN.gated_delta_rule(q[cut:total], k[cut:total], v[cut:total], g[cut:total], beta[cut:total], states,
                                  _batch([total - cut], [2]))]
    for t in range(total, total + 3):
        # a decode batch: the sequence plus a padding row on scratch slot 0
        rows = [t, t]
        parts.append(GDN.gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states,
                                          _batch([1, 1], [2, 0]))[:1])
    want, final = _oracle(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state0)
    torch.testing.assert_close(torch.cat(parts), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[2], final, rtol=1e-4, atol=1e-4)
    assert not states[1].any() and not states[3].any()


def test_causal_conv1d_carries_its_state_like_transformers() -> None:
    lengths, slots = [1, 9, 2, 30], [2, 4, 1, 3]
    g = _gen(4)
    x = torch.randn(sum(lengths), CONV_DIM, generator=g)
    weight = torch.randn(CONV_DIM, KERNEL, generator=g)
    states = torch.randn(5, CONV_DIM, KERNEL - 1, generator=g)
    before = states.clone()
    out = GDN.causal_conv1d(x, weight, states, _batch(lengths, slots))
    start = 0
    for n, slot in zip(lengths, slots):
        oracle_state = before[slot][None].clone()
        want = hf.causal_conv1d_update(x[start:start + n].T[None], oracle_state, weight, None, "silu")[0].T
        torch.testing.assert_close(out[start:start + n], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slot], oracle_state[0], rtol=0, atol=0)
        start += n
    torch.testing.assert_close(states[0], before[0], rtol=0, atol=0)


def test_conv_from_a_zero_state_is_transformers_prefill_and_decode_rows_shift_by_one() -> None:
    g = _gen(5)
    x = torch.randn(7, CONV_DIM, generator=g)
    weight = torch.randn(CONV_DIM, KERNEL, generator=g)
    states = torch.zeros(3, CONV_DIM, KERNEL - 1)
    out = GDN.causal_conv1d(x[:6], weight, states, _batch([6], [1]))
    torch.testing.assert_close(out, hf.causal_conv1d_fn(x[:6].T[None], weight, None, "silu")[0].T, rtol=1e-5,
                               atol=1e-5)
    step = GDN.causal_conv1d(x[6:].expand(2, -1), weight, states, _batch([1, 1], [1, 0]))
    full = hf.causal_conv1d_fn(x.T[None], weight, None, "silu")[0].T
    torch.testing.assert_close(step[0], full[6], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[1], x[4:7].T, rtol=0, atol=0)


def test_gated_rms_norm_and_gates_match_transformers() -> None:
    g = _gen(6)
    x, z = torch.randn(10, DV, generator=g), torch.randn(10, DV, generator=g)
    norm = hf.Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV, generator=g))
        want = norm(x, z)
    torch.testing.assert_close(GDN.gated_rms_norm(x, z, norm.weight.detach(), 1e-6), want, rtol=1e-6, atol=1e-6)
    a, b = torch.randn(10, HV, generator=g), torch.randn(10, HV, generator=g)
    a_log, dt_bias = torch.rand(HV, generator=g).log(), torch.randn(HV, generator=g)
    decay, beta = GDN.gdn_gates(a, b, a_log, dt_bias)
    torch.testing.assert_close(decay, -a_log.exp() * F.softplus(a + dt_bias), rtol=0, atol=0)
    torch.testing.assert_close(beta, b.sigmoid(), rtol=0, atol=0)
    assert decay.dtype == beta.dtype == torch.float32 and bool((decay <= 0).all())


def test_pools_are_zeroed_and_reset_clears_only_the_named_slots() -> None:
    pools = GDN.allocate_state_pools(2, 4, CONV_DIM, KERNEL, HV, DK, DV, torch.bfloat16)
    (conv, rec), _ = pools
    assert conv.shape == (4, CONV_DIM, KERNEL - 1) and conv.dtype == torch.bfloat16
    assert rec.shape == (4, HV, DK, DV) and rec.dtype == torch.float32
    assert not any(t.any() for pair in pools for t in pair)
    for pair in pools:
        for t in pair:
            t.fill_(1)
    GDN.reset_slots(pools, torch.tensor([1, 3], dtype=torch.int32))
    for pair in pools:
        for t in pair:
            assert not t[[1, 3]].any() and bool((t[[0, 2]] == 1).all())
