"""Qwen3.5's full-attention path through the FusedOps port: per-head q/k norm + partial RoPE (a cos/sin cache
narrower than the head) + paged store, then paged attention at head_dim 256 — a ragged prefill, then decode
steps (split-KV), on the GPU also replayed from a captured CUDA graph — against a dense torch reference."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
from infer_core.ports.fused_ops import AttentionBatch
from tests.backend_cuda.conftest import HAS_CUDA, gpu, poison
from tests.backend_cuda.reference import make_cos_sin_cache, ref_qk_norm_rope

EPS = 1e-6
# (Hq, Hkv, head_dim, rotary_dim, block_size, prompt lengths)
TINY = (4, 1, 256, 16, 4, [5, 2, 9])
QWEN35 = (16, 4, 256, 64, 16, [300, 1, 77, 16])


class _Seqs:
    """Random sequences in shuffled pages, with the dense (reference) history of their rotated k and v."""

    def __init__(self, hq, hkv, d, rot, bs, lens, dtype, device, extra_tokens):
        self.gen = torch.Generator().manual_seed(sum(lens) + d)
        self.hq, self.hkv, self.d, self.bs, self.dtype, self.device = hq, hkv, d, bs, dtype, device
        self.lens = list(lens)
        pages = [(n + extra_tokens + bs - 1) // bs for n in lens]
        perm = torch.randperm(sum(pages) + 2, generator=self.gen).to(torch.int32)
        self.block_tables = torch.full((len(lens), max(pages)), -1, dtype=torch.int32)
        at = 0
        for i, p in enumerate(pages):
            self.block_tables[i, :p] = perm[at : at + p]
            at += p
        self.k_cache = poison(torch.empty((sum(pages) + 2, bs, hkv, d), dtype=dtype, device=device))
        self.v_cache = poison(torch.empty_like(self.k_cache))
        self.cs = make_cos_sin_cache(4096, rot, device=device)
        self.qw = (torch.rand(d, generator=self.gen) + 0.5).to(dtype=dtype, device=device)
        self.kw = (torch.rand(d, generator=self.gen) + 0.5).to(dtype=dtype, device=device)
        self.hist_k = [torch.zeros((0, hkv, d)) for _ in lens]
        self.hist_v = [torch.zeros((0, hkv, d)) for _ in lens]
        self.ctx = [0] * len(lens)
        self.ops = TritonFusedOps(CudaMathOps())

    def step_inputs(self, q_lens):
        """q, k, v for `q_lens[i]` new tokens per sequence, and the AttentionBatch of that step."""
        t = sum(q_lens)
        q, k, v = (torch.randn((t, h, self.d), generator=self.gen).to(self.dtype) for h in (self.hq, self.hkv, self.hkv))
        pos, slots = [], []
        for i, n in enumerate(q_lens):
            for p in range(self.ctx[i], self.ctx[i] + n):
                pos.append(p)
                slots.append(int(self.block_tables[i, p // self.bs]) * self.bs + p % self.bs)
        qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        seq_lens = [c + n for c, n in zip(self.ctx, q_lens)]
        dev = self.device
        batch = AttentionBatch(
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=self.block_tables.to(dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            is_decode=all(n == 1 for n in q_lens),
            block_size=self.bs,
        )
        return q.to(dev), k.to(dev), v.to(dev), batch

    def run(self, q, k, v, batch):
        rq, _ = self.ops.qk_norm_rope_store(
            q, k, v, batch.positions, self.cs, self.qw, self.kw, EPS, self.k_cache, self.v_cache, batch.slot_mapping
        )
        return self.ops.paged_attention(rq, self.k_cache, self.v_cache, batch, self.d**-0.5)

    def reference(self, q, k, v, q_lens, positions):
        """Dense fp32 causal GQA attention of the new rows over each sequence's history + new rows; advances it."""
        rq, rk = ref_qk_norm_rope(q.cpu(), k.cpu(), positions.cpu(), self.cs.cpu(), self.qw.cpu(), self.kw.cpu(), EPS)
        out, at, rep = [], 0, self.hq // self.hkv
        for i, n in enumerate(q_lens):
            self.hist_k[i] = torch.cat([self.hist_k[i], rk[at : at + n].float()])
            self.hist_v[i] = torch.cat([self.hist_v[i], v[at : at + n].float().cpu()])
            keys = self.hist_k[i].repeat_interleave(rep, dim=1)
            vals = self.hist_v[i].repeat_interleave(rep, dim=1)
            s = torch.einsum("qhd,khd->hqk", rq[at : at + n].float(), keys) * self.d**-0.5
            ctx = keys.shape[0]
            visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
            s = s.masked_fill(~visible[None], float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vals))
            self.ctx[i] += n
            at += n
        return torch.cat(out)


def _check_prefill_then_decode(case, dtype, device, graph: bool):
    hq, hkv, d, rot, bs, lens = case
    seqs = _Seqs(hq, hkv, d, rot, bs, lens, dtype, device, extra_tokens=3)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    q, k, v, batch = seqs.step_inputs(lens)
    out = seqs.run(q, k, v, batch)
    torch.testing.assert_close(out.float().cpu(), seqs.reference(q, k, v, lens, batch.positions), **tol)
    for _ in range(3):
        q, k, v, batch = seqs.step_inputs([1] * len(lens))
        if graph:
            # Captured on copies of this step's inputs; replay must reproduce the eager result.
            bufs = [x.clone() for x in (q, k, v)]
            seqs.run(*bufs, batch)  # warm-up outside the capture (compiles)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = seqs.run(*bufs, batch)
            out.fill_(float("nan"))
            g.replay()
        else:
            out = seqs.run(q, k, v, batch)
        torch.testing.assert_close(out.float().cpu(), seqs.reference(q, k, v, [1] * len(lens), batch.positions), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_head_dim_256_prefill_then_decode(dtype, device):
    _check_prefill_then_decode(TINY, dtype, device, graph=False)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graph", [False, True])
def test_qwen35_attention_prefill_then_decode(graph, device):
    _check_prefill_then_decode(QWEN35, torch.bfloat16, device, graph=graph)
