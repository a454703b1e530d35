"""On the GPU: the vision tower on the CUDA backend gives the CPU reference's embeddings (fp32), and stays close
in BF16, for two images of different grids in one call."""

from __future__ import annotations

import pytest
import torch

from infer_worker.components.vision import VisionConfig, VisionTower
from infer_worker.components.weights import WeightInit
from infer_worker.infrastructure.backend_registry import create_backend

pytestmark = pytest.mark.gpu
CONFIG = VisionConfig(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, in_channels=3, patch_size=16,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=320, num_position_embeddings=256)
GRIDS = [(1, 16, 12), (1, 6, 20)]


def _tower(backend_name: str, dtype: torch.dtype, source: VisionTower | None) -> VisionTower:
    backend = create_backend(backend_name, "")
    tower = VisionTower(backend.ops, CONFIG, dtype, backend.device)
    slots = tower.weight_slots()
    if source is None:
        generator = torch.Generator(device=backend.device).manual_seed(0)
        for name in sorted(slots):
            slots[name].init_dummy(generator)
            if slots[name].init is not WeightInit.NORMAL:  # norms and biases too: every weight takes part
                slots[name].tensor.add_(torch.randn(slots[name].tensor.shape, generator=generator) * 0.1)
    else:
        for name, slot in source.weight_slots().items():
            slots[name].load(name, slot.tensor)
    return tower


def test_cuda_tower_equals_cpu() -> None:
    cpu = _tower("cpu", torch.float32, None)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), CONFIG.patch_dim, generator=torch.Generator().manual_seed(1))
    expected = cpu(pixels, GRIDS)
    fp32 = _tower("cuda", torch.float32, cpu)(pixels.cuda(), GRIDS).cpu()
    torch.testing.assert_close(fp32, expected, rtol=2e-3, atol=2e-3)
    bf16 = _tower("cuda", torch.bfloat16, cpu)(pixels.cuda(), GRIDS).float().cpu()
    cos = torch.nn.functional.cosine_similarity(bf16, expected, dim=-1)
    assert cos.min() > 0.99, cos.min()
