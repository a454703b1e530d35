"""On the GPU: the tiny Qwen3.5 with its vision tower serves a batch of image and text prompts on the CUDA backend
with the CPU reference's greedy tokens (fp32): the tower, the scatter of its embeddings and the per-token rotary
rows of 3-D positions (`AttentionBatch.rope_cos_sin` through the CUDA `qk_norm_rope_store`) in eager prefill steps,
and the decode steps of the image sequences (positions shifted by their delta) replaying decode graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer_core.dtypes import DType
from infer_worker.application.image_inputs import ImageInputs
from infer_worker.application.model_runner import ModelRunner
from infer_worker.domain.sequence import Sampling, Sequence
from tests.worker.image_prompts import IMAGE_PAD, ONE, TWO, VISION_END, VISION_START, image_prompt, text
from tests.worker.qwen3_5_checkpoints import load_hybrid, qwen3_5_vl_config, random_qwen3_5
from tests.worker.tiny_checkpoints import greedy_steps

pytestmark = pytest.mark.gpu
BLOCK, BLOCKS_PER_SEQ, SLOTS = 16, 4, 4
PROMPTS = [image_prompt(ONE), (text(9, 7), []), image_prompt(TWO)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5-vl-cuda")
    random_qwen3_5(qwen3_5_vl_config(IMAGE_PAD, VISION_START, VISION_END), seed=5).save_pretrained(path)
    return path


def _greedy(model_dir: Path, backend_name: str, graphs: bool, steps: int = 12) -> tuple[list[list[int]], int]:
    from infer_worker.application.graph_runner import GraphModelRunner
    from infer_worker.infrastructure.backend_registry import create_backend

    backend = create_backend(backend_name, "", DType.FLOAT32)
    model, caches = load_hybrid(model_dir, backend, 16, BLOCK, SLOTS, DType.FLOAT32)
    args = (model, backend, caches.per_layer, BLOCK, BLOCKS_PER_SEQ, backend.device)
    runner = (GraphModelRunner(*args, state_pools=caches.state_pools, capture_sizes=[1, 2, 4]) if graphs
              else ModelRunner(*args, state_pools=caches.state_pools))
    if graphs:
        runner.capture()
    assert model.visual is not None
    runner.images = ImageInputs(model.visual, multimodal_rope=True)
    seqs = []
    for i, (prompt, images) in enumerate(PROMPTS):
        seq = Sequence(i, list(prompt), 0, list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)),
                       Sampling(temperature=0.0), state_slot=i + 1)
        runner.images.admit(seq, images)
        seqs.append(seq)
    greedy_steps(runner, seqs, steps)
    return [s.token_ids[len(p):] for s, (p, _) in zip(seqs, PROMPTS)], getattr(runner, "graph_steps", 0)


def test_cuda_fp32_greedy_of_image_and_text_prompts_equals_cpu(model_dir: Path) -> None:
    cpu, _ = _greedy(model_dir, "cpu", graphs=False)
    cuda, _ = _greedy(model_dir, "cuda", graphs=False)
    replayed, graph_steps = _greedy(model_dir, "cuda", graphs=True)
    assert cuda == cpu
    assert replayed == cpu and graph_steps == 11  # the prefill step eager, every decode step a graph
