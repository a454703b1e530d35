"""On the GPU: the CUDA backend gives the CPU reference's greedy tokens (fp32), BF16 logits stay close, and
CUDA-graph replay gives the eager tokens. Checkpoints are SmolLM2-shaped and Qwen3-shaped random models the
test writes (the embedded SmolLM2's GGUF is 98 MB and cannot travel to the device machine); `qwen3_hd128` has
head_dim 128, where the Hopper prefill attention (`attention_prefill_ws.py`) serves the BF16 runs' queries over
INFER_CUDA_WS_PREFILL_ABOVE tokens (these prompts are shorter: the logits test runs it with the threshold at 0 too)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from infer_core.dtypes import DType
from infer_worker.domain.sequence import Sampling, ScheduledSeq, Sequence
from tests.worker.tiny_checkpoints import forward_step

pytestmark = pytest.mark.gpu
BLOCK = 16
PROMPTS = [[1, 450, 7042, 282, 4649, 314], list(range(100, 140)), [5, 9, 13], list(range(2000, 2070, 3))]


def _write(kind: str, path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                  initializer_range=0.1, rms_norm_eps=1e-5)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=100000.0,
                                                                        tie_word_embeddings=True))
    else:
        head_dim = 128 if kind == "qwen3_hd128" else 64
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=head_dim,
                                                                        tie_word_embeddings=True))
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def _runner(model_dir: Path, backend_name: str, dtype: DType, graphs: bool = False):  # noqa: ANN202
    from infer_worker.application.graph_runner import GraphModelRunner
    from infer_worker.application.model_runner import ModelRunner
    from infer_worker.infrastructure.backend_registry import create_backend
    from infer_worker.infrastructure.model_loader import load_model

    backend = create_backend(backend_name, "")
    model, spec = load_model(model_dir, backend, dtype, "auto", 0)
    caches = backend.allocate_kv_cache(spec.num_layers, 64, BLOCK, spec.num_kv_heads, spec.head_dim, dtype)
    if graphs:
        runner = GraphModelRunner(model, backend, caches, BLOCK, 8, backend.device, capture_sizes=[1, 2, 4, 8])
        runner.capture()
        return runner
    return ModelRunner(model, backend, caches, BLOCK, 8, backend.device)


def _greedy(runner, steps: int = 16) -> list[list[int]]:  # noqa: ANN001
    seqs = [Sequence(i, list(p), 0, list(range(i * 8, i * 8 + 8)), Sampling(temperature=0.0))
            for i, p in enumerate(PROMPTS)]
    scheduled = [ScheduledSeq(s, s.num_tokens) for s in seqs]
    for _ in range(steps):
        out = runner.execute(scheduled)
        for s, item, tok in zip(seqs, scheduled, out.token_ids):
            s.num_computed += item.num_new
            s.token_ids.append(tok)
        scheduled = [ScheduledSeq(s, 1) for s in seqs]
    return [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cuda_fp32_greedy_equals_cpu(kind: str, tmp_path: Path) -> None:
    model_dir = _write(kind, tmp_path / kind)
    cpu = _greedy(_runner(model_dir, "cpu", DType.FLOAT32))
    cuda = _greedy(_runner(model_dir, "cuda", DType.FLOAT32))
    assert cuda == cpu


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_hd128"])
def test_cuda_graph_replay_equals_eager(kind: str, tmp_path: Path) -> None:
    model_dir = _write(kind, tmp_path / kind)
    eager = _greedy(_runner(model_dir, "cuda", DType.BFLOAT16))
    runner = _runner(model_dir, "cuda", DType.BFLOAT16, graphs=True)
    replayed = _greedy(runner)
    assert runner.graph_steps == 15  # every decode step replayed a graph
    assert replayed == eager


@pytest.mark.parametrize(("kind", "ws_above"), [("qwen3", 256), ("qwen3_hd128", 256), ("qwen3_hd128", 0)])
def test_cuda_bf16_logits_close_to_cpu_fp32(kind: str, ws_above: int, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from infer_backend_cuda.kernels import attention_prefill_ws

    monkeypatch.setattr(attention_prefill_ws, "ABOVE", ws_above)  # 0: the 40-token prompt on the Hopper kernel
    model_dir = _write(kind, tmp_path / kind)
    ref, got = {}, {}
    for name, dtype, store in (("cpu", DType.FLOAT32, ref), ("cuda", DType.BFLOAT16, got)):
        runner = _runner(model_dir, name, dtype)
        seq = Sequence(0, list(PROMPTS[1]), 0, list(range(8)), Sampling(temperature=0.0))
        step = __import__("infer_worker.application.model_runner", fromlist=["prepare_step"]).prepare_step(
            [ScheduledSeq(seq, seq.num_tokens)], BLOCK, 8)
        hidden = forward_step(runner, step)
        store["logits"] = runner.model.compute_logits(hidden).float().cpu()
    a, b = ref["logits"], got["logits"]
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert float(cos.min()) > 0.995
    assert math.isfinite(float(b.abs().max()))
    assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())
