"""The CUDA-graph decode runner's buffer logic (padding to a capture size, greedy/stochastic graphs, eager
fallback) checked on the CPU: a backend whose "graph" replays by calling the captured step reads and writes
the same address-stable buffers the real graph does. Real capture is covered by tests/gpu."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from infer_backend_cpu import CpuBackend
from infer_core.dtypes import DType
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.domain.sequence import Sampling, ScheduledSeq, Sequence
from infer_worker.infrastructure.model_loader import load_model
from tests.worker.tiny_checkpoints import qwen3_config, write_checkpoint


class _Replay:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class ReplayingCpuBackend(CpuBackend):
    supports_graphs = True

    def capture_graph(self, fn: Callable[[], None], warmup: int = 1) -> _Replay:
        for _ in range(warmup):
            fn()
        return _Replay(fn)


def _decode(runner: ModelRunner, prompts: list[list[int]], sampling: Sampling, steps: int) -> list[list[int]]:
    seqs = [Sequence(i, list(p), 0, list(range(i * 8, i * 8 + 8)), sampling) for i, p in enumerate(prompts)]
    work = [ScheduledSeq(s, s.num_tokens) for s in seqs]
    for _ in range(steps):
        out = runner.execute(work)
        assert out.seq_ids == [s.seq_id for s in seqs]
        for s, item, tok in zip(seqs, work, out.token_ids):
            s.num_computed += item.num_new
            s.token_ids.append(tok)
        work = [ScheduledSeq(s, 1) for s in seqs]
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


def test_graph_decode_equals_eager_with_padding(tmp_path: Path) -> None:
    write_checkpoint(qwen3_config(tied=True), tmp_path)
    prompts = [[3, 5, 7, 9, 11], [20, 21], [40, 41, 42, 43, 44, 45, 46]]  # 3 sequences -> padded to 4
    for sampling in (Sampling(temperature=0.0), Sampling(temperature=0.9, top_k=20, seed=7)):
        results = []
        for graphs in (False, True):
            backend = ReplayingCpuBackend()
            model, spec = load_model(tmp_path, backend, DType.FLOAT32, "auto", 0)
            caches = backend.allocate_kv_cache(spec.num_layers, 32, 4, spec.num_kv_heads, spec.head_dim, DType.FLOAT32)
            if graphs:
                runner: ModelRunner = GraphModelRunner(model, backend, caches, 4, 8, "cpu", capture_sizes=[1, 2, 4],
                                                       capture_tokens=[16, 8])
                assert runner.graph_step_tokens == ()  # nothing captured yet
                runner.capture()
                assert runner.graph_step_tokens == (8, 16)  # what the scheduler fits chunks to (Ready)
            else:
                runner = ModelRunner(model, backend, caches, 4, 8, "cpu")
                assert runner.graph_step_tokens == ()
            results.append(_decode(runner, prompts, sampling, steps=6))
            if graphs:
                assert isinstance(runner, GraphModelRunner)
                # the 14-token prefill replayed the (16 tokens, 4 sequences) graph, every decode a decode graph
                assert (runner.mixed_graph_steps, runner.graph_steps) == (1, 5)
        assert results[0] == results[1]


def test_mixed_graphs_bound_prompt_chunks_and_eager_steps_count_them(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`mixed_chunk_seqs` (Config.mixed_graph_chunk_seqs): a step with more prompt chunks than the mixed graphs
    were captured for runs eagerly, with its exact count in the attention batch; one within the bound replays a
    graph whose batch carries the bound. The tokens are those of the unbounded runner."""
    from infer_backend_cpu.fused_ops import CpuFusedOps
    from infer_core.ports.fused_ops import AttentionBatch

    seen: list[int | None] = []
    attend = CpuFusedOps.qk_norm_rope_attention

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(next(a for a in args if isinstance(a, AttentionBatch)).max_chunk_seqs)
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(CpuFusedOps, "qk_norm_rope_attention", spy)
    write_checkpoint(qwen3_config(tied=True), tmp_path)
    prompts = [[3, 5, 7, 9, 11], [20, 21], [40, 41, 42, 43, 44, 45, 46]]  # three prompt chunks in the first step
    results = []
    for bound, eager, mixed in ((0, 0, 1), (2, 1, 0), (3, 0, 1)):
        backend = ReplayingCpuBackend()
        model, spec = load_model(tmp_path, backend, DType.FLOAT32, "auto", 0)
        caches = backend.allocate_kv_cache(spec.num_layers, 32, 4, spec.num_kv_heads, spec.head_dim, DType.FLOAT32)
        runner = GraphModelRunner(model, backend, caches, 4, 8, "cpu", capture_sizes=[1, 2, 4], capture_tokens=[16],
                                  mixed_chunk_seqs=bound)
        runner.capture()
        captured = set(seen)
        seen.clear()
        results.append(_decode(runner, prompts, Sampling(temperature=0.0), steps=3))
        assert (runner.eager_steps, runner.mixed_graph_steps, runner.graph_steps) == (eager, mixed, 2)
        assert None in captured and (bound or None) in captured  # the decode graphs' and the mixed graphs' batches
        if eager:
            assert seen[0] == 3  # the eager step's three prompt chunks, counted
        seen.clear()
    assert results[0] == results[1] == results[2]
