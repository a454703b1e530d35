"""The image embeddings of a step: each image through the vision tower once, in the first step that reaches it
(the images a step reaches first together), its rows at the right step rows, kept across chunks until consumed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from infer_backend_cpu import CpuBackend
from infer_protocol.messages import ImageInput
from infer_worker.application.image_embeddings import ImageEmbeddings, StepChunk
from infer_worker.application.patch_values import patch_values
from infer_worker.components.vision import VisionConfig, VisionTower
from tests.worker.image_prompts import float_patches

CONFIG = VisionConfig(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=2,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=24, num_position_embeddings=16)


class RecordingTower(VisionTower):
    """The real tower, recording the grids of each call."""

    def __init__(self) -> None:
        super().__init__(CpuBackend().ops, CONFIG, torch.float32, "cpu")
        self.calls: list[list[tuple[int, int, int]]] = []
        generator = torch.Generator().manual_seed(0)
        for _, slot in sorted(self.weight_slots().items()):
            slot.init_dummy(generator)
            slot.tensor.add_(torch.randn(slot.tensor.shape, generator=generator) * 0.3)

    def __call__(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        self.calls.append(list(grid_thw))
        return super().__call__(pixel_values, grid_thw)


def image(offset: int, grid: tuple[int, int, int], seed: int) -> ImageInput:
    """Random bytes with a random table per channel (each image its own, as two processors' settings would give)."""
    rng = np.random.default_rng(seed)
    patches = rng.integers(0, 256, (grid[1] * grid[2], CONFIG.patch_dim), dtype=np.uint8)
    table = rng.standard_normal((CONFIG.in_channels, 256)).astype(np.float32)
    return ImageInput(offset=offset, num_tokens=grid[1] * grid[2] // 4, grid_thw=grid, patches=patches.tobytes(),
                      shape=patches.shape, value_table=table.tobytes(), content_hash=f"{seed:032x}")


def alone(tower: VisionTower, im: ImageInput) -> torch.Tensor:
    pixels = torch.from_numpy(float_patches(im, CONFIG.values_per_channel))
    return VisionTower.__call__(tower, pixels, [im.grid_thw])


def replaced(im: ImageInput, **fields: object) -> ImageInput:
    return ImageInput(**{**{f: getattr(im, f) for f in im.__struct_fields__}, **fields})


def test_patch_bytes_are_looked_up_in_their_channels_table() -> None:
    im = image(0, (1, 2, 2), 4)
    values = patch_values(im, CONFIG.values_per_channel, "cpu")
    assert values.dtype == torch.float32
    assert torch.equal(values, torch.from_numpy(float_patches(im, CONFIG.values_per_channel)))
    table = np.frombuffer(im.value_table, dtype=np.float32).reshape(CONFIG.in_channels, 256)
    first = np.frombuffer(im.patches, dtype=np.uint8)[:CONFIG.patch_dim]
    per = CONFIG.values_per_channel  # the last channel's columns come from its own row of the table
    assert values[0, -per:].tolist() == table[-1, first[-per:]].tolist()


def test_chunked_prefill_encodes_each_image_once() -> None:
    tower = RecordingTower()
    cache = ImageEmbeddings(tower)
    a0, a1 = image(3, (1, 4, 4), 1), image(10, (1, 2, 4), 2)  # 4 and 2 tokens
    b0 = image(1, (1, 4, 6), 3)  # 6 tokens
    cache.admit(1, [a0, a1])
    cache.admit(2, [b0])
    cache.admit(3, [])  # text only

    rows, emb = cache.step_embeddings([StepChunk(1, 0, 5, 0), StepChunk(3, 0, 4, 5), StepChunk(2, 0, 8, 9)])
    assert tower.calls == [[(1, 4, 4), (1, 4, 6)]]  # the two images first reached, in one call
    assert rows.tolist() == [3, 4] + list(range(10, 16))
    torch.testing.assert_close(emb, torch.cat([alone(tower, a0)[:2], alone(tower, b0)]))
    assert cache.num_cached == 1  # b0 is consumed; a0 waits for its last two tokens

    rows, emb = cache.step_embeddings([StepChunk(2, 8, 9, 0), StepChunk(1, 5, 12, 1)])
    assert tower.calls[1:] == [[(1, 2, 4)]]  # a0 from the cache, a1 new
    assert rows.tolist() == [1, 2, 6, 7]
    torch.testing.assert_close(emb, torch.cat([alone(tower, a0)[2:], alone(tower, a1)]))
    assert cache.num_cached == 0
    assert cache.step_embeddings([StepChunk(1, 12, 13, 0), StepChunk(2, 9, 10, 1)]) is None  # decodes


def test_readmission_after_preemption_encodes_again() -> None:
    tower = RecordingTower()
    cache = ImageEmbeddings(tower)
    im = image(2, (1, 4, 4), 1)
    cache.admit(7, [im])
    cache.step_embeddings([StepChunk(7, 0, 3, 0)])
    cache.forget(7)  # preempted
    assert cache.num_cached == 0
    cache.admit(7, [im])
    rows, emb = cache.step_embeddings([StepChunk(7, 0, 8, 0)])
    assert len(tower.calls) == 2 and rows.tolist() == [2, 3, 4, 5]
    torch.testing.assert_close(emb, alone(tower, im))


def test_an_image_whose_grid_does_not_give_its_tokens_is_refused() -> None:
    cache = ImageEmbeddings(RecordingTower())
    bad = image(0, (1, 4, 4), 1)
    with pytest.raises(ValueError, match="does not give"):
        cache.admit(1, [replaced(bad, num_tokens=3)])


@pytest.mark.parametrize(("field", "value", "match"), [
    ("patches", b"\0" * 5, "patch bytes"), ("shape", (16, 8), "patch bytes"), ("value_table", b"\0" * 1024, "table"),
])
def test_an_image_whose_bytes_do_not_fit_the_tower_is_refused(field: str, value: object, match: str) -> None:
    cache = ImageEmbeddings(RecordingTower())
    with pytest.raises(ValueError, match=match):
        cache.admit(1, [replaced(image(0, (1, 4, 4), 1), **{field: value})])


def test_tower_calls_hold_at_most_the_profiled_patches() -> None:
    """A step reaching many images first encodes them in calls of at most the budget the memory profile covered
    (a larger image alone), with each image's embeddings those it gets alone."""
    from infer_worker.application.image_embeddings import tower_groups

    assert tower_groups([10, 10, 10], 25) == [range(0, 2), range(2, 3)]
    assert tower_groups([40, 5, 5, 30], 25) == [range(0, 1), range(1, 3), range(3, 4)]
    assert tower_groups([], 25) == []
    tower = RecordingTower()
    cache = ImageEmbeddings(tower, patches_per_call=24)
    ims = [image(0, (1, 4, 4), 1), image(4, (1, 4, 4), 2), image(8, (1, 2, 4), 3)]  # 16, 16 and 8 patches
    cache.admit(1, ims)
    rows, emb = cache.step_embeddings([StepChunk(1, 0, 10, 0)])
    assert tower.calls == [[(1, 4, 4)], [(1, 4, 4), (1, 2, 4)]]
    torch.testing.assert_close(emb, torch.cat([alone(tower, im) for im in ims]))


def test_the_worst_case_tower_call_covers_the_largest_accepted_image() -> None:
    from infer_worker.application.image_embeddings import TOWER_PATCHES_PER_CALL, profile_tower, worst_case_grid

    tower = RecordingTower()  # patch 2, merge 2
    t, h, w = worst_case_grid(tower, 1000 * 1000)  # 250,000 patches of 2x2 pixels
    assert t == 1 and h == w and h % 2 == 0 and h * w >= 250_000 and (h - 2) ** 2 < 250_000
    _, h, w = worst_case_grid(tower, 16)  # a tiny image limit: the call budget rules
    assert h * w >= TOWER_PATCHES_PER_CALL and (h - 2) ** 2 < TOWER_PATCHES_PER_CALL
    profile_tower(tower, 16)  # what the memory profile runs
    assert tower.calls == [[(1, h, w)]]
