"""The CudaBackend class: import without a GPU, entry point, construction errors; on a GPU the sampler
against the reference scheme, graph capture + replay, memory and KV-cache allocation."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

from infer_core.dtypes import DType
from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.sampler import SamplingBatch
from tests.backend_cuda.conftest import HAS_CUDA, gpu, needs_cuda
from tests.backend_cuda.reference import make_cos_sin_cache, ref_sample_row


def test_import_without_triton_or_numba_loaded():
    """`import infer_backend_cuda` pulls in neither triton nor numba (they load when a backend is built)."""
    code = "import sys, infer_backend_cuda; print('triton' in sys.modules, 'numba' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "False"]


def test_entry_point_resolves():
    eps = importlib.metadata.entry_points(group="rustinfer.backends")
    ep = {e.name: e for e in eps}["cuda"]
    assert ep.value == "infer_backend_cuda:CudaBackend"
    cls = ep.load()
    assert cls.name == "cuda" and cls.supports_graphs is True
    assert cls.host_memory is False  # its KV cache is sized by a memory profile


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error")
def test_construct_without_cuda_raises_clear_error():
    from infer_backend_cuda import CudaBackend

    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        CudaBackend(device="cuda:0")
    with pytest.raises(RuntimeError):
        CudaBackend(device="")


# ------------------------------------------------------------------------------------------------ GPU only


@pytest.fixture(scope="module")
def backend():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    from infer_backend_cuda import CudaBackend

    return CudaBackend(device="")


@gpu
@needs_cuda
def test_backend_basics(backend):
    assert backend.device == "cuda:0" and backend.name == "cuda"
    assert backend.default_dtype() is DType.BFLOAT16
    assert type(backend)(device="cuda:0", dtype=DType.FLOAT16).default_dtype() is DType.FLOAT16  # as constructed
    assert backend.torch_dtype(DType.FLOAT16) is torch.float16
    info = backend.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    backend.reset_peak_memory()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    assert backend.peak_memory_bytes() >= 64 << 20
    del x
    kv = backend.allocate_kv_cache(3, 10, 16, 2, 64, DType.BFLOAT16)
    assert len(kv) == 3
    for k, v in kv:
        assert k.shape == v.shape == (10, 16, 2, 64) and k.dtype is torch.bfloat16 and k.is_contiguous()
        assert k.data_ptr() != v.data_ptr()
    backend.synchronize()


def _ref_sampler_batch(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [
        (
            [0.0, 0.8, 1.0, 1.4][i % 4],
            [0, 40, 0, 0, 5][i % 5],
            [1.0, 0.9, 0.7][i % 3],
            [0.0, 0.0, 0.05][i % 3],
            int(torch.randint(-(2**62), 2**62, (1,), generator=g)),
            int(torch.randint(0, 2**20, (1,), generator=g)),
        )
        for i in range(n)
    ]
    logits = torch.randn((n, vocab), generator=g) * 4
    return rows, logits


def _sbatch(rows, device):
    t, k, p, m, s, pos = zip(*rows)
    f = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return SamplingBatch(f(t, torch.float32), f(p, torch.float32), f(k, torch.int32), f(m, torch.float32), f(s, torch.int64), f(pos, torch.int64), False)


@gpu
@needs_cuda
def test_backend_sampler_matches_reference_scheme(backend):
    rows, logits = _ref_sampler_batch(24, 151936, 7)
    out = backend.ops.sampler.sample(logits.cuda(), _sbatch(rows, "cuda"))
    want = [ref_sample_row(logits[i], *rows[i]) for i in range(len(rows))]
    assert out.token_ids.cpu().tolist() == want
    ref_lp = torch.log_softmax(logits, -1).gather(1, out.token_ids.cpu()[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs.cpu(), ref_lp, atol=1e-4, rtol=1e-5)


@gpu
@needs_cuda
def test_graph_capture_replay_equals_eager(backend):
    """A small decode-like op sequence (norm -> qk-norm/rope/store -> decode attention -> silu -> sampler)
    captured once, replayed on new contents of the same buffers, equals the eager result."""
    dev = "cuda"
    ops = backend.ops
    B, hq, hkv, d, bs, nblk, hidden, vocab = 4, 8, 2, 64, 16, 32, 128, 1000
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(s, generator=g).to(dev)  # noqa: E731
    kc = torch.zeros((nblk, bs, hkv, d), device=dev)
    vc = torch.zeros_like(kc)
    w_norm, w_qkv, w_up, w_out = r(hidden), r((hq + 2 * hkv) * d, hidden) * 0.1, r(2 * hidden, hq * d) * 0.1, r(vocab, hidden) * 0.1
    cs = make_cos_sin_cache(4096, d, device=dev)
    # persistent inputs
    x = r(B, hidden)
    positions = torch.zeros(B, dtype=torch.int64, device=dev)
    slots = torch.zeros(B, dtype=torch.int64, device=dev)
    seq_lens = torch.zeros(B, dtype=torch.int32, device=dev)
    bt = torch.arange(B * 8, dtype=torch.int32, device=dev).view(B, 8)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
    sb = _sbatch([(1.0, 0, 0.9, 0.0, 5, 0)] * B, dev)
    out_tok = torch.zeros(B, dtype=torch.int64, device=dev)
    out_lp = torch.zeros(B, device=dev)

    def step():
        h = ops.fused.rms_norm(x, w_norm, 1e-6)
        qkv = ops.math.linear(h, w_qkv)
        q = qkv[:, : hq * d].view(B, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(B, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(B, hkv, d)
        q, k = ops.fused.qk_norm_rope_store(q, k, v, positions, cs, None, None, 1e-6, kc, vc, slots)
        batch = AttentionBatch(positions, slots, qsl, seq_lens, bt, 1, 64, True, bs)
        o = ops.fused.paged_attention(q, kc, vc, batch, d**-0.5)
        u = ops.fused.silu_and_mul(ops.math.linear(o.view(B, hq * d), w_up))
        hh, _ = ops.fused.add_rms_norm(u, x, w_norm, 1e-6)
        res = ops.sampler.sample(ops.math.linear(hh, w_out), sb)
        out_tok.copy_(res.token_ids)
        out_lp.copy_(res.logprobs)

    def set_step(t):
        positions.fill_(t)
        seq_lens.copy_(torch.tensor([t + 1, t + 1, 0, t + 1], dtype=torch.int32))
        slots.copy_(torch.tensor([(i * 8 + t // bs) * bs + t % bs if i != 2 else -1 for i in range(B)]))
        sb.positions.fill_(t)
        x.copy_(torch.randn((B, hidden), generator=torch.Generator().manual_seed(t)))

    kc0, vc0 = kc.clone(), vc.clone()
    eager = []
    for t in range(5):
        set_step(t)
        step()
        eager.append((out_tok.clone(), out_lp.clone()))
    kc.copy_(kc0)
    vc.copy_(vc0)
    set_step(0)
    graph = backend.capture_graph(step, warmup=2)
    kc.copy_(kc0)
    vc.copy_(vc0)
    for t in range(5):
        set_step(t)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_tok, eager[t][0]), f"step {t}"
        torch.testing.assert_close(out_lp, eager[t][1])
