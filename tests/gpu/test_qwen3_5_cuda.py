"""On the GPU: a Qwen3.5-shaped hybrid model (Gated DeltaNet + gated attention with partial rotary) on the CUDA
backend gives the CPU reference's greedy tokens (fp32), its bf16 logits stay close to them, and decode-graph
replay gives the eager tokens. Needs the CUDA backend's `OpPorts.gdn` and partial rotary in its
`qk_norm_rope_store`. The checkpoint is written here by transformers (a random model, tied embeddings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer_core.dtypes import DType
from infer_worker.application.model_runner import ModelRunner, prepare_step
from infer_worker.domain.sequence import Sampling, ScheduledSeq, Sequence
from tests.worker.qwen3_5_checkpoints import load_hybrid, write_qwen3_5
from tests.worker.tiny_checkpoints import forward_step, greedy_steps

pytestmark = pytest.mark.gpu
BLOCK, BLOCKS_PER_SEQ, SLOTS = 16, 8, 8
# head_dim 128 with 32 rotary dims, 4 key / 8 value heads of 64 in the linear layers, 2 prompts past a WY chunk
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=4096, initializer_range=0.1,
             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                              "mrope_section": [6, 5, 5], "mrope_interleaved": True})  # 16 rotary frequencies
PROMPTS = [[1, 450, 702, 282, 469, 314], list(range(100, 200)), [5], list(range(2000, 2093, 3)),
           list(range(3000, 3070))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5-cuda")
    write_qwen3_5(path, seed=0, **SHAPE)
    return path


def _runner(model_dir: Path, backend_name: str, dtype: DType, graphs: bool = False) -> ModelRunner:
    from infer_worker.application.graph_runner import GraphModelRunner
    from infer_worker.infrastructure.backend_registry import create_backend

    backend = create_backend(backend_name, "", dtype)
    model, caches = load_hybrid(model_dir, backend, 64, BLOCK, SLOTS, dtype)
    args = (model, backend, caches.per_layer, BLOCK, BLOCKS_PER_SEQ, backend.device)
    if not graphs:
        return ModelRunner(*args, state_pools=caches.state_pools)
    runner = GraphModelRunner(*args, state_pools=caches.state_pools, capture_sizes=[1, 2, 4, 8])
    runner.capture()
    return runner


def _greedy(runner: ModelRunner, steps: int = 16) -> list[list[int]]:
    seqs = [Sequence(i, list(p), 0, list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)),
                     Sampling(temperature=0.0), state_slot=i + 1) for i, p in enumerate(PROMPTS)]
    greedy_steps(runner, seqs, steps)
    return [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)]


def test_cuda_fp32_greedy_equals_cpu(model_dir: Path) -> None:
    assert _greedy(_runner(model_dir, "cuda", DType.FLOAT32)) == _greedy(_runner(model_dir, "cpu", DType.FLOAT32))


def test_cuda_decode_graph_replay_equals_eager(model_dir: Path) -> None:
    eager = _greedy(_runner(model_dir, "cuda", DType.BFLOAT16))
    runner = _runner(model_dir, "cuda", DType.BFLOAT16, graphs=True)
    replayed = _greedy(runner)
    assert runner.graph_steps == 15  # every decode step replayed a graph (5 sequences padded to 8)
    assert replayed == eager


def test_cuda_bf16_logits_close_to_cpu_fp32(model_dir: Path) -> None:
    """CUDA in bf16 stays as close to the fp32 reference as the reference's own bf16 run does (measured on the
    H200: CUDA min cosine 0.9940; the CPU's own bf16 run: min 0.9947, mean 0.9990, max |diff| 0.088 of the
    largest logit): a fixed bound tighter than bf16 itself is not a property of the kernels."""
    logits = {}
    for name, backend, dtype in (("cpu", "cpu", DType.FLOAT32), ("cuda", "cuda", DType.BFLOAT16),
                                 ("cpu_bf16", "cpu", DType.BFLOAT16)):
        runner = _runner(model_dir, backend, dtype)
        seq = Sequence(0, list(PROMPTS[1]), 0, list(range(BLOCKS_PER_SEQ)), Sampling(temperature=0.0), state_slot=1)
        step = prepare_step([ScheduledSeq(seq, seq.num_tokens)], BLOCK, BLOCKS_PER_SEQ)
        logits[name] = runner.model.compute_logits(forward_step(runner, step)).float().cpu()
    a, b, own = logits["cpu"], logits["cuda"], logits["cpu_bf16"]
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    own_cos = torch.nn.functional.cosine_similarity(a, own, dim=-1)
    assert float(cos.min()) > float(own_cos.min()) - 0.005 and float(cos.mean()) > float(own_cos.mean()) - 0.002
    assert float((a - b).abs().max()) < 2 * float((a - own).abs().max())
