"""Decode graphs of a hybrid model, checked on the CPU with a backend whose "graph" replays the captured step over
the same address-stable buffers (real capture is for tests/gpu): each row's state slot is a static input,
padding rows use scratch slot 0, a sequence starting at position 0 inside a decode graph starts from a zeroed
slot, and the tokens equal the eager runner's. Mixed steps run eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.domain.sequence import GREEDY, Sampling, ScheduledSeq, Sequence
from tests.worker.qwen3_5_checkpoints import load_hybrid, write_qwen3_5
from tests.worker.test_graph_runner import ReplayingCpuBackend

BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5-graphs")
    write_qwen3_5(path, seed=4)
    return path


def _runner(model_dir: Path, graphs: bool) -> ModelRunner:
    backend = ReplayingCpuBackend()
    model, caches = load_hybrid(model_dir, backend, 40, BLOCK_SIZE, 6)
    for pool in caches.state_pools:  # what earlier sequences left in the slots: each new one must start from zero
        for tensor in pool:
            tensor.fill_(0.5)
    if not graphs:
        return ModelRunner(model, backend, caches.per_layer, BLOCK_SIZE, BLOCKS_PER_SEQ, "cpu",
                           state_pools=caches.state_pools)
    runner = GraphModelRunner(model, backend, caches.per_layer, BLOCK_SIZE, BLOCKS_PER_SEQ, "cpu",
                              state_pools=caches.state_pools, capture_sizes=[1, 2, 4], capture_tokens=[8, 16])
    runner.capture()
    return runner


def _run(runner: ModelRunner, prompts: list[list[int]], sampling: Sampling, steps: int) -> list[list[int]]:
    """Prefill the first prompts together, then decode; the 1-token prompt joins at the first decode (a fresh
    sequence in a decode-shaped step)."""
    seqs = [Sequence(i, list(p), 0, list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)), sampling,
                     state_slot=i + 1) for i, p in enumerate(prompts)]
    work = [ScheduledSeq(s, s.num_tokens) for s in seqs[:-1]]
    for step in range(steps):
        if step == 1:
            work.append(ScheduledSeq(seqs[-1], 1))
        out = runner.execute(work)
        for item, tok in zip(work, out.token_ids, strict=True):
            item.seq.num_computed += item.num_new
            item.seq.token_ids.append(tok)
        work = [ScheduledSeq(item.seq, 1) for item in work]
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.9, top_k=20, seed=7)], ids=["greedy", "sampled"])
def test_decode_graphs_equal_eager_with_padding_and_a_fresh_row(model_dir: Path, sampling: Sampling) -> None:
    prompts = [[3, 5, 7, 9, 11], [40, 41, 42, 43, 44, 45, 46], [77]]  # 3 decoding sequences: padded to 4
    eager = _run(_runner(model_dir, graphs=False), prompts, sampling, steps=7)
    graphs = _runner(model_dir, graphs=True)
    assert isinstance(graphs, GraphModelRunner)
    assert _run(graphs, prompts, sampling, steps=7) == eager
    assert (graphs.eager_steps, graphs.mixed_graph_steps, graphs.graph_steps) == (1, 0, 6)
    assert graphs.graph_step_tokens == ()  # a hybrid model's mixed steps run eagerly: no bucket to fit chunks to


def test_decode_graphs_that_stop_at_the_logits_serve_rows_that_need_processing(model_dir: Path) -> None:
    """A penalised row sends its decode steps to the graphs that stop at the logits (state slots as static inputs
    there too): tokens equal the eager runner's, and no decode step runs eagerly."""
    prompts = [[3, 5, 7, 9, 11], [40, 41, 42, 43, 44, 45, 46], [77]]
    penalised = Sampling(temperature=0.9, top_k=20, seed=7, presence_penalty=1.5, repetition_penalty=1.3)
    eager = _run(_runner(model_dir, graphs=False), prompts, penalised, steps=7)
    graphs = _runner(model_dir, graphs=True)
    assert isinstance(graphs, GraphModelRunner)
    assert _run(graphs, prompts, penalised, steps=7) == eager
    assert (graphs.eager_steps, graphs.graph_steps, graphs.decode_logits_steps) == (1, 6, 6)
