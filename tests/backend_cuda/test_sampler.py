"""The GPU sampler (torch filtering + the Numba seeded-draw kernel) against the spec's reference scheme.

Under NUMBA_ENABLE_CUDASIM=1 the kernel runs in Numba's simulator on the CPU tensors' numpy views, through
the same launcher as on the GPU."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda import numba_kernels
from infer_backend_cuda.sampler import CudaSampler, cut_thresholds
from infer_core.ports.sampler import SamplingBatch
from tests.backend_cuda.conftest import gpu, poison
from tests.backend_cuda.reference import mix32_t, ref_sample_row, ref_uniforms


def _batch(rows, device, all_greedy=False):
    """rows: (temperature, top_k, top_p, min_p, seed, position)."""
    t, k, p, m, s, pos = zip(*rows)
    return SamplingBatch(
        temperature=torch.tensor(t, dtype=torch.float32, device=device),
        top_p=torch.tensor(p, dtype=torch.float32, device=device),
        top_k=torch.tensor(k, dtype=torch.int32, device=device),
        min_p=torch.tensor(m, dtype=torch.float32, device=device),
        seeds=torch.tensor(s, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        all_greedy=all_greedy,
    )


def _logits(n, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n, vocab), generator=g) * 3).to(device)


ROWS = [
    (0.0, 0, 1.0, 0.0, 1, 0),  # greedy
    (1.0, 0, 1.0, 0.0, 42, 7),  # plain sampling
    (0.7, 5, 1.0, 0.0, 42, 8),  # top-k
    (1.3, 0, 0.8, 0.0, -5, 123),  # top-p, negative seed
    (1.0, 0, 1.0, 0.2, 2**40 + 3, 2**33),  # min-p, seed / position beyond 32 bits
    (0.9, 20, 0.9, 0.05, 7, 1),  # all three
    (2.0, 1, 1.0, 0.0, 9, 99),  # top-k 1 == greedy on the scaled logits
    (1.0, 0, 0.0, 0.0, 9, 100),  # top-p 0 keeps only the top token
]


def _check(logits, rows, device):
    out = CudaSampler(device).sample(logits, _batch(rows, device))
    want = [ref_sample_row(logits[i], *rows[i][:1], rows[i][1], rows[i][2], rows[i][3], rows[i][4], rows[i][5]) for i in range(len(rows))]
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device.type == torch.device(device).type
    assert out.token_ids.cpu().tolist() == want
    ref_lp = torch.log_softmax(logits.float(), -1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    return out


def test_mixed_rows_match_reference(device):
    _check(_logits(len(ROWS), 96, device), ROWS, device)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_rows_match_reference(seed, device):
    g = torch.Generator().manual_seed(100 + seed)
    rows = []
    for i in range(6):
        rows.append(
            (
                [0.0, 0.5, 1.0, 1.5][int(torch.randint(4, (1,), generator=g))],
                [0, 0, 3, 40][int(torch.randint(4, (1,), generator=g))],
                [1.0, 0.95, 0.5][int(torch.randint(3, (1,), generator=g))],
                [0.0, 0.0, 0.1][int(torch.randint(3, (1,), generator=g))],
                int(torch.randint(-(2**40), 2**40, (1,), generator=g)),
                int(torch.randint(0, 2**20, (1,), generator=g)),
            )
        )
    _check(_logits(6, 70, device, seed), rows, device)


def test_draw_is_independent_of_batch_composition(device):
    """A row's token depends only on its own (logits, params, seed, position), not on its neighbours."""
    logits = _logits(len(ROWS), 64, device, 5)
    full = CudaSampler(device).sample(logits, _batch(ROWS, device)).token_ids.cpu()
    perm = [5, 2, 7, 0]
    part = CudaSampler(device).sample(logits[perm], _batch([ROWS[i] for i in perm], device)).token_ids.cpu()
    assert part.tolist() == full[perm].tolist()


def test_all_greedy_path(device):
    logits = _logits(4, 50, device, 3)
    rows = [(0.0, 0, 1.0, 0.0, i, i) for i in range(4)]
    out = CudaSampler(device).sample(logits, _batch(rows, device, all_greedy=True))
    assert out.token_ids.cpu().tolist() == torch.argmax(logits.cpu(), -1).tolist()
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("chunks", [1, 3])
def test_kernel_partials_and_merge(chunks, device):
    """The raw Numba kernel + merge: greedy rows = arg-max of the logits (first index on ties), sampled rows
    with nothing filtered = argmax softmax / -log(u), logprob = log_softmax at the token; any chunking."""
    n, vocab = 5, 50
    logits = _logits(n, vocab, device, 8)
    logits[0, 3] = logits[0, 40] = logits[0].max() + 1.0  # a tie across chunks: the lower index wins
    temp = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.5], device=device)
    seeds = torch.arange(n, dtype=torch.int64, device=device) * 1000003
    pos = torch.arange(n, dtype=torch.int64, device=device) + 17
    no_cut = logits.min(dim=1).values
    parts = numba_kernels.sample_partials(
        logits, temp, no_cut, logits.max(dim=1).values, torch.zeros(n, device=device), seeds, pos, False, chunks=chunks
    )
    assert parts[0].shape == (n, chunks)
    tok, lp = numba_kernels.merge_partials(logits, *parts)
    got = tok.cpu().tolist()
    assert got[0] == 3 and got[3] == int(torch.argmax(logits[3].cpu()))
    for i in (1, 2, 4):
        p = torch.softmax(logits[i].cpu() / float(temp[i]), -1).double()
        u = ref_uniforms(int(seeds[i]), int(pos[i]), vocab)
        assert got[i] == int(torch.argmax(p / -torch.log(u)))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1))
    # all_greedy flag: every row arg-max, whatever the temperatures say
    tok_g, _ = numba_kernels.merge_partials(
        logits, *numba_kernels.sample_partials(logits, temp, no_cut, no_cut, no_cut * 0, seeds, pos, True, chunks=chunks)
    )
    assert tok_g.cpu().tolist() == [3] + torch.argmax(logits[1:].cpu(), -1).tolist()


def test_cut_threshold_semantics(device):
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]], device=device)
    thr = lambda *row: float(cut_thresholds(logits, _batch([row], device))[0][0])  # noqa: E731
    assert thr(1.0, 0, 1.0, 0.0, 0, 0) == 0.0  # nothing cut
    assert thr(1.0, 2, 1.0, 0.0, 0, 0) == 3.0  # top-k 2
    p0 = float(torch.softmax(logits[0], -1)[0])  # 0.636
    assert thr(1.0, 0, p0 + 0.01, 0.0, 0, 0) == 3.0  # top-p just above the top token's mass: two tokens
    assert thr(1.0, 0, p0 - 0.01, 0.0, 0, 0) == 4.0  # below it: the top token alone
    assert thr(1.0, 0, 0.0, 0.0, 0, 0) == 4.0  # top-p 0 keeps the top token
    assert thr(1.0, 3, 0.99, 0.0, 0, 0) == 2.0  # top-p over the renormalised top-3


def test_min_p_and_top_k_never_pick_filtered_tokens(device):
    """Over many positions, only kept tokens are drawn, and more than one of them."""
    vocab, n = 5, 40
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]], device=device).expand(n, vocab).contiguous()
    for row, allowed in (((1.0, 0, 1.0, 0.1), {0, 1, 2}), ((1.0, 2, 1.0, 0.0), {0, 1})):
        rows = [(*row, 77, p) for p in range(n)]
        got = set(CudaSampler(device).sample(logits, _batch(rows, device)).token_ids.cpu().tolist())
        assert got <= allowed and len(got) >= 2, got


def test_hash_reference_values():
    """Pin the counter-based hash to values computed with plain Python ints."""

    def mix32(x):
        m = 0xFFFFFFFF
        x = (((x >> 16) ^ x) * 0x45D9F3B) & m
        x = (((x >> 16) ^ x) * 0x45D9F3B) & m
        return (x >> 16) ^ x

    for seed, pos in [(0, 0), (42, 7), (-5, 123), (2**40 + 3, 2**33)]:
        h = mix32((seed & 0xFFFFFFFF) ^ mix32(pos & 0xFFFFFFFF))
        u = ref_uniforms(seed, pos, 4)
        assert u.tolist() == [(float(mix32((h + v) & 0xFFFFFFFF)) + 0.5) / 2**32 for v in range(4)]
    assert int(mix32_t(torch.tensor(123456789))) == mix32(123456789)


@gpu
@pytest.mark.parametrize("vocab", [151936, 32000, 49152])
def test_large_vocab_matches_reference(vocab, device):
    n = 16
    g = torch.Generator().manual_seed(vocab)
    rows = [
        (
            [0.0, 0.6, 1.0][i % 3],
            [0, 50, 0, 1000][i % 4],
            [1.0, 0.9, 0.95][i % 3],
            [0.0, 0.05][i % 2],
            int(torch.randint(0, 2**62, (1,), generator=g)),
            int(torch.randint(0, 2**16, (1,), generator=g)),
        )
        for i in range(n)
    ]
    _check(_logits(n, vocab, device, vocab), rows, device)


@pytest.mark.parametrize("vocab", [37, 3000])
def test_threshold_kernel_matches_torch(vocab, device):
    """The Triton top-k / top-p cut over sorted rows (several 1024-wide chunks for the larger vocab) equals a
    plain torch cumsum formulation."""
    from infer_backend_cuda.kernels.sampling import topk_topp_threshold

    rows = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 25, 1.0), (1.0, 10, 0.5), (0.0, 0, 0.8), (2.0, 0, 0.999), (1.0, 0, 0.0), (0.5, 3000, 0.95)]
    n = len(rows)
    logits = _logits(n, vocab, device, vocab)
    sv = torch.sort(logits, dim=-1, descending=True).values
    temp = torch.tensor([r[0] for r in rows], device=device)
    top_k = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device)
    top_p = torch.tensor([r[2] for r in rows], device=device)
    thr, mx = topk_topp_threshold(sv, temp, top_k, top_p)
    assert torch.equal(mx, sv[:, 0])
    for i, (t, k, p) in enumerate(rows):
        t = t or 1.0
        k = vocab if k <= 0 or k > vocab else k
        e = torch.exp((sv[i, :k].double() - sv[i, 0]) / t).cpu()
        before = torch.cumsum(e, 0) - e
        n_keep = k if p >= 1.0 else max(1, int((before < p * e.sum()).sum()))
        assert float(thr[i]) == float(sv[i, n_keep - 1]), (i, rows[i])


def _cpu_sampler():
    cpu = pytest.importorskip("infer_backend_cpu.sampler")
    return cpu.CpuSampler()


@pytest.mark.parametrize("seed", [0, 1])
def test_agrees_with_cpu_backend_sampler(seed, device):
    """Same tokens and logprobs as the CPU reference backend's sampler for the same seeds (fp32 logits
    without exact ties; with tied logits at a top-k / top-p cut the backends may keep different tokens:
    this one keeps every token equal to the cut value, the CPU one cuts by sort rank)."""
    n, vocab = 12, 300
    g = torch.Generator().manual_seed(500 + seed)
    rows = [
        (
            [0.0, 0.6, 1.0, 1.7][i % 4],
            [0, 0, 7, 120][(i + seed) % 4],
            [1.0, 0.9, 0.6][i % 3],
            [0.0, 0.0, 0.08][(i + 1) % 3],
            int(torch.randint(-(2**40), 2**40, (1,), generator=g)),
            int(torch.randint(0, 2**24, (1,), generator=g)),
        )
        for i in range(n)
    ]
    logits = (torch.randn((n, vocab), generator=g) * 2.5).to(device)
    batch = _batch(rows, device)
    ours = CudaSampler(device).sample(logits, batch)
    ref = _cpu_sampler().sample(logits.cpu(), _batch(rows, "cpu"))
    assert ours.token_ids.cpu().tolist() == ref.token_ids.tolist()
    torch.testing.assert_close(ours.logprobs.cpu(), ref.logprobs, atol=1e-5, rtol=1e-5)


@gpu
def test_agrees_with_cpu_backend_sampler_full_vocab(device):
    n, vocab = 32, 151936
    g = torch.Generator().manual_seed(9)
    rows = [([0.0, 0.7, 1.0][i % 3], [0, 50, 0, 0][i % 4], [1.0, 0.95, 0.8][i % 3], [0.0, 0.02][i % 2], 1000 + i, 7 * i) for i in range(n)]
    logits = torch.randn((n, vocab), generator=g) * 3
    ours = CudaSampler(device).sample(logits.to(device), _batch(rows, device))
    ref = _cpu_sampler().sample(logits, _batch(rows, "cpu"))
    assert ours.token_ids.cpu().tolist() == ref.token_ids.tolist()
    torch.testing.assert_close(ours.logprobs.cpu(), ref.logprobs, atol=1e-4, rtol=1e-5)
