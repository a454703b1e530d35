"""On the GPU: contexts past 20k tokens give the CPU reference's greedy tokens (fp32 on both), eager and through
the graph runner with capture on, driven by the real scheduler Engine and WorkerService with the one-step-ahead
pipeline, chunked prefill and the prefix cache — the settings of issue 13's crash (max_model_len 32768,
max_batch_tokens 8192, chunks of 2048, the default capture sizes and token buckets), where a 9,000-token prompt
ended in a device-side assert after 3,000, 4,200 and 6,000-token ones had worked.

The model is tiny (hidden 64, 2 layers) so the whole test stays well under a minute on an H200; most of its time
is the CPU reference's attention over 20k keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer_core.dtypes import DType
from infer_protocol.config import Config
from infer_protocol.messages import SamplingParams, Submit

pytestmark = pytest.mark.gpu

BLOCK = 16
MAX_MODEL_LEN = 32768
NUM_BLOCKS = 4096  # 65k tokens: every request of a run at once, no preemption
VOCAB = 512
LENGTHS = [3000, 4200, 6000, 9000, 20500]  # the crash's sequence, then past 20k
NEW_TOKENS = 8


def _write(path: Path) -> Path:
    from tests.worker.tiny_checkpoints import qwen3_config, write_checkpoint

    config = qwen3_config(tied=True, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          max_position_embeddings=MAX_MODEL_LEN, initializer_range=0.5)
    write_checkpoint(config, path, seed=3)
    return path


def _submits() -> list[Submit]:
    """Each prompt extends the one before (so later ones hit the prefix cache), as a client resending a growing
    conversation does."""
    base = [(7919 * i + 13) % (VOCAB - 1) + 1 for i in range(max(LENGTHS))]
    return [Submit(request_id=f"n{n}", prompt_token_ids=base[:n], sampling=SamplingParams(temperature=0.0),
                   max_tokens=NEW_TOKENS) for n in LENGTHS]


def _serve(model_dir: Path, backend_name: str, graphs: bool) -> tuple[dict[str, tuple[list[int], str | None]], object]:
    from infer_worker.application.graph_runner import GraphModelRunner
    from infer_worker.application.model_runner import ModelRunner
    from infer_worker.infrastructure.backend_registry import create_backend
    from infer_worker.infrastructure.model_loader import load_model
    from tests.worker.test_overlap_pipeline import serve

    defaults = Config()
    backend = create_backend(backend_name, "")
    model, spec = load_model(model_dir, backend, DType.FLOAT32, "auto", 0)
    caches = backend.allocate_kv_cache(spec.num_layers, NUM_BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim,
                                       DType.FLOAT32)
    max_blocks = MAX_MODEL_LEN // BLOCK
    if graphs:
        runner: ModelRunner = GraphModelRunner(model, backend, caches, BLOCK, max_blocks, backend.device,
                                               capture_sizes=[s for s in defaults.capture_sizes if s <= 8],
                                               capture_tokens=defaults.capture_tokens)
        runner.capture()
    else:
        runner = ModelRunner(model, backend, caches, BLOCK, max_blocks, backend.device)
    out, engine = serve(runner, _submits(), overlap=True, num_blocks=NUM_BLOCKS, initial=1, block_size=BLOCK,
                        max_model_len=MAX_MODEL_LEN, max_batch_tokens=8192, chunked_prefill_size=2048,
                        vocab_size=VOCAB)
    assert engine.kv.num_free + engine.kv.num_cached == engine.kv.num_blocks
    return out, runner


def test_cuda_greedy_past_20k_tokens_equals_cpu(tmp_path: Path) -> None:
    from infer_worker.application.graph_runner import GraphModelRunner

    model_dir = _write(tmp_path / "qwen3-32k")
    cpu, _ = _serve(model_dir, "cpu", graphs=False)
    assert all(reason == "length" and len(tokens) == NEW_TOKENS for tokens, reason in cpu.values()), cpu
    eager, _ = _serve(model_dir, "cuda", graphs=False)
    assert eager == cpu
    graphed, runner = _serve(model_dir, "cuda", graphs=True)
    assert graphed == cpu
    assert isinstance(runner, GraphModelRunner) and runner.graph_steps and runner.mixed_graph_steps
