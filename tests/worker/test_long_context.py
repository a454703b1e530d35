"""Every prompt length up to max_model_len, across every buffer whose size is not max_model_len (the list is in
docs/architecture.md, "Size-bearing buffers"), at the model-runner level: the real scheduler Engine drives the
real WorkerService over the eager ModelRunner and over the GraphModelRunner (its static buffers and bucket
choice, replayed on the CPU), with the one-step-ahead pipeline, chunked prefill, running decodes and the prefix
cache on and off. The oracle is HF transformers' greedy continuation on the same weights.

The limits are small so each boundary is cheap to cross: block_size 4, max_model_len = the model's
max_position_embeddings (the cos/sin table's rows) = 64 = 16 blocks (the block-table width), decode graphs up
to 4 sequences and mixed graphs up to 16 tokens, chunks of at most 17 tokens and 24 tokens per step. Prompt
lengths sit at boundary-1, boundary and boundary+1 of each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from infer_core.dtypes import DType
from infer_protocol.messages import SamplingParams, Submit
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner
from infer_worker.infrastructure.model_loader import load_model
from tests.worker.test_graph_runner import ReplayingCpuBackend
from tests.worker.test_overlap_pipeline import serve
from tests.worker.tiny_checkpoints import hf_greedy, qwen3_config, write_checkpoint

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64  # = max_position_embeddings: the cos/sin table has exactly these rows
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE  # the block-table width
CAPTURE_SIZES = [1, 2, 4]  # decode graphs: the static buffers' sequence rows
CAPTURE_TOKENS = [8, 16]  # mixed graphs: the static buffers' token rows
CHUNK = 17  # chunked_prefill_size: one past the largest mixed graph
BATCH_TOKENS = 24  # max_batch_tokens
NUM_BLOCKS = 96  # enough for every test's requests at once (no preemption: tested in test_overlap_pipeline)

# boundary -> why it matters
BOUNDARIES = {
    BLOCK_SIZE: "one KV block",
    CAPTURE_TOKENS[0]: "the smallest mixed-graph token bucket",
    CAPTURE_TOKENS[-1]: "the largest mixed graph (more tokens run eagerly)",
    CHUNK: "chunked_prefill_size (a longer prompt takes two chunks)",
    BATCH_TOKENS: "max_batch_tokens",
    MAX_MODEL_LEN - 2: "max_model_len (the longest prompt is max_model_len - 1)",
}
PROMPT_LENGTHS = sorted({n + d for n in BOUNDARIES for d in (-1, 0, 1) if 0 < n + d < MAX_MODEL_LEN})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp("qwen3-longctx")
    model = write_checkpoint(qwen3_config(tied=True, max_position_embeddings=MAX_MODEL_LEN), path, seed=11)
    return path, model


def prompt_of(length: int, shared: int = 10) -> list[int]:
    """The first `shared` tokens are common to every prompt (prefix-cache hits at page granularity)."""
    return [(5 * j + 3) % 250 + 1 for j in range(min(length, shared))] + [
        (31 * length + 7 * j) % 250 + 1 for j in range(max(0, length - shared))]


@pytest.fixture(scope="module")
def expected(checkpoint: tuple[Path, PreTrainedModel]) -> dict[int, list[int]]:
    """HF greedy continuations to max_model_len, per prompt length."""
    _, hf = checkpoint
    return {n: hf_greedy(hf, prompt_of(n), MAX_MODEL_LEN - n) for n in PROMPT_LENGTHS}


def make_runner(model_dir: Path, graphs: bool) -> ModelRunner:
    backend = ReplayingCpuBackend()
    model, spec = load_model(model_dir, backend, DType.FLOAT32, "auto", 0)
    assert spec.max_position_embeddings == MAX_MODEL_LEN
    caches = backend.allocate_kv_cache(spec.num_layers, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim,
                                       DType.FLOAT32)
    if not graphs:
        return ModelRunner(model, backend, caches, BLOCK_SIZE, MAX_BLOCKS, backend.device)
    runner = GraphModelRunner(model, backend, caches, BLOCK_SIZE, MAX_BLOCKS, backend.device,
                              capture_sizes=CAPTURE_SIZES, capture_tokens=CAPTURE_TOKENS)
    runner.capture()
    return runner


def run(model_dir: Path, lengths: list[int], *, graphs: bool, prefix_caching: bool,
        overlap: bool = True) -> tuple[dict[str, tuple[list[int], str | None]], ModelRunner]:
    subs = [Submit(request_id=f"n{n}", prompt_token_ids=prompt_of(n), sampling=SamplingParams(temperature=0.0),
                   max_tokens=MAX_MODEL_LEN) for n in lengths]
    runner = make_runner(model_dir, graphs)
    # One at a time (each after a step's result): the first prefill runs alone, the next ones beside decodes.
    out, engine = serve(runner, subs, overlap=overlap, num_blocks=NUM_BLOCKS, initial=1, block_size=BLOCK_SIZE,
                        max_model_len=MAX_MODEL_LEN, max_batch_tokens=BATCH_TOKENS, chunked_prefill_size=CHUNK,
                        enable_prefix_caching=prefix_caching)
    assert engine.kv.num_free + engine.kv.num_cached == engine.kv.num_blocks
    return out, runner


GROUPS = {"all": PROMPT_LENGTHS} | {f"{n}+-1": [m for m in (n - 1, n, n + 1) if 0 < m < MAX_MODEL_LEN]
                                    for n in BOUNDARIES}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-replay"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_every_boundary_length_generates_to_max_model_len(checkpoint: tuple[Path, PreTrainedModel],
                                                          expected: dict[int, list[int]], graphs: bool,
                                                          prefix_caching: bool, group: str) -> None:
    """The prompts of one boundary (or all at once: then prefill chunks share steps with up to 14 running
    decodes, more than any decode graph holds) each generate until the context is full: the last computed
    position is max_model_len - 2, the last entry of the block table is used, and every token equals HF's.
    A group of three stays within the decode graphs, and its steps cross the mixed-graph buckets."""
    model_dir, _ = checkpoint
    lengths = GROUPS[group]
    out, runner = run(model_dir, lengths, graphs=graphs, prefix_caching=prefix_caching)
    for n in lengths:
        tokens, reason = out[f"n{n}"]
        assert reason == "length", n
        assert tokens == expected[n], f"prompt of {n} tokens ({graphs=}, {prefix_caching=})"
    if not isinstance(runner, GraphModelRunner) or group == "all":
        return
    if max(lengths) < MAX_MODEL_LEN - 4:  # (prompts near max_model_len fill the steps and hardly decode)
        assert runner.graph_steps and runner.mixed_graph_steps
    if max(lengths) > CAPTURE_TOKENS[-1] and not prefix_caching:  # a 17-token chunk is beyond every mixed graph
        assert runner.eager_steps


@pytest.mark.parametrize("length", [CAPTURE_TOKENS[-1] - 1, CAPTURE_TOKENS[-1], CAPTURE_TOKENS[-1] + 1,
                                    MAX_MODEL_LEN - 1])
def test_a_lone_prompt_at_a_boundary(checkpoint: tuple[Path, PreTrainedModel], length: int) -> None:
    """One request alone (no decodes beside its chunks), synchronous pipeline: its single prefill step is just
    below, at or just above the largest mixed graph; the longest prompt there is samples its one token."""
    model_dir, hf = checkpoint
    out, runner = run(model_dir, [length], graphs=True, prefix_caching=False, overlap=False)
    tokens, reason = out[f"n{length}"]
    assert reason == "length"
    assert tokens == hf_greedy(hf, prompt_of(length), MAX_MODEL_LEN - length)
    assert isinstance(runner, GraphModelRunner)
    if length <= CAPTURE_TOKENS[-1]:
        assert runner.eager_steps == 0
    elif length < CHUNK + 1:
        assert runner.eager_steps == 1


def test_prompt_positions_beyond_the_cos_sin_table_are_refused_not_read(checkpoint: tuple[Path, PreTrainedModel]
                                                                       ) -> None:
    """The cos/sin table has max_position_embeddings rows; the runner's block-table width caps a sequence at
    max_model_len <= that, so no position past the table can reach a kernel (the CUDA one would read beyond it
    unchecked)."""
    from infer_worker.domain.sequence import GREEDY, ScheduledSeq, Sequence

    model_dir, _ = checkpoint
    runner = make_runner(model_dir, graphs=False)
    too_long = MAX_MODEL_LEN + 1
    seq = Sequence(1, prompt_of(too_long), 0, list(range(MAX_BLOCKS + 1)), GREEDY)
    with pytest.raises(ValueError, match=f"may have at most {MAX_BLOCKS}"):
        runner.execute([ScheduledSeq(seq, too_long)])
    assert torch.is_tensor(runner.model.layers[0].mixer.cos_sin_cache)
    assert runner.model.layers[0].mixer.cos_sin_cache.shape[0] == MAX_MODEL_LEN
