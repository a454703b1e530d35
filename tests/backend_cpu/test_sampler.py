"""The reference sampler: greedy, filters, counter-based seeded draws and their distribution."""

from __future__ import annotations

import math

import pytest
import torch

from infer_backend_cpu.counter_rng import counter_uniform, mix32
from infer_backend_cpu.sampler import CpuSampler, filtered_probs
from infer_core.ports import SamplingBatch

SAMPLER = CpuSampler()
M = 0xFFFFFFFF


def _batch(
    n: int,
    temperature: float | list[float] = 1.0,
    top_p: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    min_p: float | list[float] = 0.0,
    seeds: int | list[int] = 0,
    positions: int | list[int] = 0,
) -> SamplingBatch:
    def col(value: float | list[float] | int | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(value if isinstance(value, list) else [value] * n, dtype=dtype)

    temperatures = col(temperature, torch.float32)
    return SamplingBatch(
        temperature=temperatures,
        top_p=col(top_p, torch.float32),
        top_k=col(top_k, torch.int32),
        min_p=col(min_p, torch.float32),
        seeds=col(seeds, torch.int64),
        positions=col(positions, torch.int64),
        all_greedy=bool((temperatures == 0).all()),
    )


def _logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    return 3.0 * torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the counter RNG (pinned for the CUDA backend)


def _py_mix32(x: int) -> int:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M
    return (x >> 16) ^ x


def _py_uniform(seed: int, position: int, index: int) -> float:
    h = _py_mix32((seed & M) ^ _py_mix32(position & M))
    return (_py_mix32((h + index) & M) + 0.5) / 2**32


def test_counter_uniform_matches_the_specified_formula() -> None:
    seeds, positions = [0, 1, 123456789, -5, 2**40 + 3], [0, 7, 4096, 1, 2**33 + 11]
    u = counter_uniform(torch.tensor(seeds), torch.tensor(positions), 37)
    expected = torch.tensor([[_py_uniform(s, p, v) for v in range(37)] for s, p in zip(seeds, positions)], dtype=torch.float64)
    assert u.dtype == torch.float64
    assert torch.equal(u, expected)
    assert mix32(torch.tensor([0, 1, M])).tolist() == [_py_mix32(0), _py_mix32(1), _py_mix32(M)]


def test_counter_uniform_is_uniform_in_open_interval() -> None:
    u = counter_uniform(torch.arange(64), torch.arange(64) * 3, 4096)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005  # 262144 draws: sd of the mean is 0.00056
    histogram = torch.histc(u.float(), bins=16, min=0.0, max=1.0) / u.numel()
    assert float((histogram - 1 / 16).abs().max()) < 0.004


# ---------------------------------------------------------------- greedy and logprobs


def test_greedy_rows_take_the_argmax_and_report_logprobs() -> None:
    logits = _logits(6, 100, seed=1)
    for batch in (_batch(6, temperature=0.0), _batch(6, temperature=[0.0, 1.0, 0.0, 0.7, 0.0, 2.0], seeds=list(range(6)))):
        out = SAMPLER.sample(logits, batch)
        greedy_rows = batch.temperature == 0
        assert torch.equal(out.token_ids[greedy_rows], logits.argmax(-1)[greedy_rows])
        expected_logprobs = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1)
        torch.testing.assert_close(out.logprobs, expected_logprobs)
        assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


def test_logprobs_ignore_temperature_and_filters() -> None:
    logits = _logits(3, 50, seed=2)
    out = SAMPLER.sample(logits, _batch(3, temperature=0.3, top_k=5, seeds=[1, 2, 3]))
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1))


# ---------------------------------------------------------------- determinism


def test_same_seed_and_position_give_the_same_token_whatever_the_batch() -> None:
    logits = _logits(8, 500, seed=3)
    seeds, positions = [11, 12, 13, 14, 15, 16, 17, 18], [0, 5, 5, 9, 100, 3, 3, 7]
    alone = [
        int(SAMPLER.sample(logits[i : i + 1], _batch(1, seeds=seeds[i], positions=positions[i])).token_ids[0])
        for i in range(8)
    ]
    together = SAMPLER.sample(logits, _batch(8, seeds=seeds, positions=positions)).token_ids.tolist()
    order = [5, 2, 7, 0, 1, 6, 4, 3]
    shuffled = SAMPLER.sample(
        logits[order], _batch(8, seeds=[seeds[i] for i in order], positions=[positions[i] for i in order])
    ).token_ids.tolist()
    # Neighbours with other parameters (greedy, top-k) change nothing for a row either.
    mixed = SAMPLER.sample(
        torch.cat((logits[:1], _logits(2, 500, seed=4))),
        _batch(3, temperature=[1.0, 0.0, 0.5], top_k=[0, 0, 3], seeds=[seeds[0], 1, 2], positions=[positions[0], 1, 2]),
    ).token_ids.tolist()
    assert together == alone
    assert shuffled == [alone[i] for i in order]
    assert mixed[0] == alone[0]


def test_seed_and_position_both_change_the_draw() -> None:
    logits = torch.zeros(1, 1000).expand(200, 1000)  # uniform: the draw is the noise alone
    by_position = SAMPLER.sample(logits, _batch(200, seeds=5, positions=list(range(200)))).token_ids
    by_seed = SAMPLER.sample(logits, _batch(200, seeds=list(range(200)), positions=5)).token_ids
    assert len(set(by_position.tolist())) > 150 and len(set(by_seed.tolist())) > 150


# ---------------------------------------------------------------- filters


def test_top_k_one_and_tiny_top_p_and_full_min_p_equal_greedy() -> None:
    logits = _logits(16, 300, seed=5)
    greedy = logits.argmax(-1)
    common = dict(temperature=[0.5 + 0.2 * i for i in range(16)], seeds=list(range(16)), positions=list(range(16)))
    assert torch.equal(SAMPLER.sample(logits, _batch(16, top_k=1, **common)).token_ids, greedy)
    assert torch.equal(SAMPLER.sample(logits, _batch(16, top_p=1e-6, **common)).token_ids, greedy)
    assert torch.equal(SAMPLER.sample(logits, _batch(16, min_p=1.0, **common)).token_ids, greedy)


def _reference_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row, the plain way: keep a set of token ids, then renormalise."""
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    kept_probs = probs[keep] / probs[keep].sum()
    if top_p < 1.0:
        mass, nucleus = 0.0, []
        for token, p in zip(keep, kept_probs.tolist()):
            nucleus.append(token)
            mass += p
            if mass >= top_p:
                break
        keep = nucleus
    kept = probs[keep] / probs[keep].sum()
    keep = [t for t, p in zip(keep, kept.tolist()) if p >= min_p * float(kept.max())]
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.05), (0.9, 20, 0.9, 0.02)],
)
def test_filtered_probs_match_a_plain_reference(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    logits = _logits(4, 64, seed=6)
    got = filtered_probs(logits, _batch(4, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    for row in range(4):
        torch.testing.assert_close(got[row], _reference_filtered(logits[row], temperature, top_k, top_p, min_p), atol=1e-6, rtol=1e-5)


def test_sampled_tokens_stay_inside_the_filtered_support() -> None:
    logits = _logits(1, 200, seed=7).expand(2000, 200)
    batch = _batch(2000, temperature=1.5, top_k=12, top_p=0.7, seeds=3, positions=list(range(2000)))
    support = filtered_probs(logits[:1], _batch(1, temperature=1.5, top_k=12, top_p=0.7))[0] > 0
    tokens = SAMPLER.sample(logits, batch).token_ids
    assert bool(support[tokens].all())
    assert len(set(tokens.tolist())) == int(support.sum()) > 1  # and every token of the support does occur


# ---------------------------------------------------------------- the distribution


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.5, 0), (1.0, 3)])
def test_empirical_frequencies_match_the_distribution(temperature: float, top_k: int) -> None:
    probs = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.04, 0.01])
    n = 40000
    batch = _batch(n, temperature=temperature, top_k=top_k, seeds=2024, positions=list(range(n)))
    tokens = SAMPLER.sample(probs.log().expand(n, 8), batch).token_ids
    frequencies = torch.bincount(tokens, minlength=8).double() / n
    target = probs.double() ** (1 / temperature)
    if top_k:
        target[top_k:] = 0
    target /= target.sum()
    # 5 standard errors per token (<= 0.0125 at n = 40000): a sampler that ignored temperature or top-k, or
    # drew greedily or uniformly, misses by 0.05 or more.
    tolerance = 5 * torch.sqrt(target * (1 - target) / n) + 1e-9
    assert bool(((frequencies - target).abs() <= tolerance).all()), (frequencies, target)


def test_tokens_tied_with_the_cut_value_are_kept() -> None:
    """The cut is a threshold on the value (as in the CUDA backend), so ties at the cut never depend on how a
    sort orders equal values — common with bf16 logits."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 2.0, 0.0, 2.0]])
    by_top_k = filtered_probs(logits, _batch(1, top_k=2))[0]
    assert (by_top_k > 0).tolist() == [True, True, False, True, False, True]
    top_mass = float(torch.softmax(logits, -1)[0, 0])
    by_top_p = filtered_probs(logits, _batch(1, top_p=top_mass + 0.01))[0]  # the cut falls among the 2.0s
    assert (by_top_p > 0).tolist() == [True, True, False, True, False, True]
    torch.testing.assert_close(by_top_p.sum(), torch.tensor(1.0))
