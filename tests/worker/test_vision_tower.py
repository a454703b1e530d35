"""The vision tower against transformers' `Qwen3_5VisionModel`: a tiny random vision config, every weight copied by
its checkpoint name (`model.visual.*` without the prefix), outputs close in fp32 on the CPU for one image and for
two images of different grids in one call (each image attends only to itself)."""

from __future__ import annotations

import pytest
import torch

from infer_backend_cpu import CpuBackend
from infer_worker.components.vision import VisionConfig, VisionTower

TINY = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, in_channels=3, patch_size=4,
            temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=36)


@pytest.fixture(scope="module")
def towers() -> tuple[torch.nn.Module, VisionTower]:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    hf_config = Qwen3_5VisionConfig(**TINY)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = Qwen3_5VisionModel(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # random everywhere: HF's init leaves biases zero and norms one
            p.normal_(0.0, 0.2)
    ours = VisionTower(CpuBackend().ops, VisionConfig.from_hf(hf_config.to_dict()), torch.float32, "cpu")
    slots = ours.weight_slots()
    state = hf.state_dict()
    assert sorted(slots) == sorted(state)  # the same names: the checkpoint layout
    for name, tensor in state.items():
        slots[name].load(name, tensor)
    return hf, ours


def patches(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 4, 6), (1, 8, 4)], [(1, 10, 2), (1, 2, 2), (1, 6, 6)]])
def test_tower_equals_transformers(towers: tuple[torch.nn.Module, VisionTower],
                                   grids: list[tuple[int, int, int]]) -> None:
    hf, ours = towers
    pixels = torch.cat([patches(g, i) for i, g in enumerate(grids)])
    with torch.no_grad():
        expected = hf(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got = ours(pixels, grids)
    assert got.shape == (sum(ours.num_tokens(g) for g in grids), 48) == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_each_image_attends_only_to_itself(towers: tuple[torch.nn.Module, VisionTower]) -> None:
    _, ours = towers
    a, b = patches((1, 4, 6), 0), patches((1, 8, 4), 1)
    together = ours(torch.cat([a, b]), [(1, 4, 6), (1, 8, 4)])
    # Float32 GEMMs over 72 rows and over 24 sum in other orders (a CI run saw 1.8e-6); an image that saw the other
    # one would move by orders of magnitude more.
    torch.testing.assert_close(together[:6], ours(a, [(1, 4, 6)]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(together[6:], ours(b, [(1, 8, 4)]), rtol=1e-4, atol=1e-5)


def test_a_patch_count_that_does_not_match_the_grids_is_refused(towers: tuple[torch.nn.Module, VisionTower]) -> None:
    _, ours = towers
    with pytest.raises(ValueError, match="patches for the grids"):
        ours(patches((1, 4, 6), 0), [(1, 4, 4)])
