"""Without a GPU: tiny Qwen3.5 models (Gated DeltaNet + gated partial-rotary attention; and with its vision tower,
image and text prompts in one batch) served through the CUDA adapter's ports under the Triton interpreter give
the CPU reference's greedy tokens (fp32). On a GPU machine tests/gpu covers the same on the device."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer_core.dtypes import DType
from infer_worker.application.image_inputs import ImageInputs
from infer_worker.application.model_runner import ModelRunner
from infer_worker.domain.sequence import Sampling, Sequence
from tests.backend_cuda.conftest import HAS_CUDA
from tests.backend_cuda.interpreted import InterpretedCudaBackend
from tests.worker.image_prompts import IMAGE_PAD, ONE, TWO, VISION_END, VISION_START, image_prompt, text
from tests.worker.qwen3_5_checkpoints import load_hybrid, qwen3_5_vl_config, random_qwen3_5, write_qwen3_5
from tests.worker.tiny_checkpoints import greedy_steps

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="tests/gpu runs these on the device")
BLOCK, BLOCKS_PER_SEQ, SLOTS = 16, 4, 4
# Two prompts past a 64-token WY chunk of the prefill kernel, one of a single token.
TEXT_PROMPTS = [[1, 450, 102, 282, 469, 314], list(range(100, 170)), [5], list(range(200, 293, 3))]


def _greedy(model_dir: Path, backend, prompts, steps: int = 3) -> list[list[int]]:  # noqa: ANN001
    model, caches = load_hybrid(model_dir, backend, 4 * BLOCKS_PER_SEQ * 2, BLOCK, SLOTS + 1, DType.FLOAT32)
    runner = ModelRunner(model, backend, caches.per_layer, BLOCK, BLOCKS_PER_SEQ * 2, "cpu",
                         state_pools=caches.state_pools)
    if model.visual is not None:
        runner.images = ImageInputs(model.visual, multimodal_rope=True)
    seqs = []
    for i, (prompt, images) in enumerate(prompts):
        seq = Sequence(i, list(prompt), 0, list(range(i * BLOCKS_PER_SEQ * 2, (i + 1) * BLOCKS_PER_SEQ * 2)),
                       Sampling(temperature=0.0), state_slot=i + 1)
        if runner.images is not None:
            runner.images.admit(seq, images)
        seqs.append(seq)
    greedy_steps(runner, seqs, steps)
    return [s.token_ids[len(p):] for s, (p, _) in zip(seqs, prompts)]


def test_hybrid_text_model_through_the_cuda_ports_equals_cpu(tmp_path: Path) -> None:
    write_qwen3_5(tmp_path, seed=0, hidden_size=64, intermediate_size=128, head_dim=32, vocab_size=512)
    prompts = [(p, []) for p in TEXT_PROMPTS]
    expected = _greedy(tmp_path, InterpretedCudaBackend().cpu, prompts)
    assert _greedy(tmp_path, InterpretedCudaBackend(), prompts) == expected


def test_image_and_text_prompts_through_the_cuda_ports_equal_cpu(tmp_path: Path) -> None:
    random_qwen3_5(qwen3_5_vl_config(IMAGE_PAD, VISION_START, VISION_END), seed=5).save_pretrained(tmp_path)
    prompts = [image_prompt(ONE), (text(9, 7), []), image_prompt(TWO)]
    expected = _greedy(tmp_path, InterpretedCudaBackend().cpu, prompts)
    assert _greedy(tmp_path, InterpretedCudaBackend(), prompts) == expected
