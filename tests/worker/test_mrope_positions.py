"""The multimodal RoPE positions against transformers' `Qwen3_5Model.get_rope_index` (the method reads only the
vision config's merge size, so it runs here without building a model)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infer_worker.components.mrope_positions import ImageSpan, mrope_positions

PAD = 7
MERGE = 2


def hf_rope_index(ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    owner = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE)),
                            get_vision_position_ids=partial(Qwen3_5Model.get_vision_position_ids, None))
    input_ids = torch.tensor([ids])
    positions, deltas = Qwen3_5Model.get_rope_index(
        owner, input_ids, mm_token_type_ids=(input_ids == PAD).int(),
        image_grid_thw=torch.tensor(grids) if grids else None)
    return positions[:, 0].numpy(), int(deltas[0, 0])


def prompt(texts: list[int], grids: list[tuple[int, int, int]]) -> tuple[list[int], list[ImageSpan]]:
    """Text runs of the given lengths with an image between consecutive runs."""
    ids: list[int] = list(range(100, 100 + texts[0]))
    spans = []
    for grid, text in zip(grids, texts[1:], strict=True):
        n = grid[0] * grid[1] * grid[2] // MERGE**2
        spans.append(ImageSpan(len(ids), n, grid))
        ids += [PAD] * n + list(range(200, 200 + text))
    return ids, spans


@pytest.mark.parametrize(("texts", "grids"), [
    ([5], []),
    ([3, 4], [(1, 4, 6)]),
    ([3, 2, 6], [(1, 12, 2), (1, 4, 4)]),  # a tall image (large delta), then a small one
    ([1, 1], [(1, 2, 16)]),
])
def test_positions_equal_transformers(texts: list[int], grids: list[tuple[int, int, int]]) -> None:
    ids, spans = prompt(texts, grids)
    positions, delta = mrope_positions(len(ids), spans, MERGE)
    expected, expected_delta = hf_rope_index(ids, grids)
    np.testing.assert_array_equal(positions, expected)
    assert delta == expected_delta


def test_a_span_that_does_not_match_its_grid_is_refused() -> None:
    with pytest.raises(ValueError, match="has 6 tokens, not 5"):
        mrope_positions(10, [ImageSpan(2, 5, (1, 4, 6))], MERGE)
    with pytest.raises(ValueError, match="out of order"):
        mrope_positions(10, [ImageSpan(2, 6, (1, 4, 6)), ImageSpan(4, 1, (1, 2, 2))], MERGE)
