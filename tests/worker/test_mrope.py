"""Multimodal RoPE against transformers: the positions against `Qwen3_5Model.get_rope_index` (the method reads only
the vision config's merge size, so it runs here without building a model), the angles against
`Qwen3_5TextRotaryEmbedding` (partial rotary, interleaved sections)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infer_worker.components.mrope import ImageSpan, mrope_cos_sin, mrope_positions

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


def test_cos_sin_equal_transformers_text_rotary() -> None:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    section = [4, 2, 2]  # of 8 frequencies (head_dim 32, partial rotary 0.5): frequency 7 turns with t, not h
    config = Qwen3_5TextConfig(head_dim=32, hidden_size=64, num_attention_heads=2, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": section})
    rotary = Qwen3_5TextRotaryEmbedding(config)
    assert rotary.mrope_section == section
    ids, spans = prompt([3, 2, 4], [(1, 8, 4), (1, 2, 6)])
    positions, _ = mrope_positions(len(ids), spans, MERGE)
    position_ids = torch.from_numpy(positions)[:, None, :]  # [3, batch 1, N]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), position_ids)
    got = mrope_cos_sin(torch.from_numpy(positions), rotary.inv_freq, section)
    half = rotary.inv_freq.shape[0]
    torch.testing.assert_close(got[:, :half], cos[0, :, :half])
    torch.testing.assert_close(got[:, half:], sin[0, :, :half])
    torch.testing.assert_close(cos[0, :, half:], cos[0, :, :half])  # NeoX: the two halves turn alike


def test_text_positions_give_ordinary_rope() -> None:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    positions = torch.arange(5).expand(3, 5)
    got = mrope_cos_sin(positions, inv_freq, [3, 3, 2])
    angles = torch.arange(5, dtype=torch.float32)[:, None] * inv_freq
    torch.testing.assert_close(got, torch.cat((angles.cos(), angles.sin()), dim=-1))
    with pytest.raises(ValueError, match="does not cover"):
        mrope_cos_sin(positions, inv_freq, [3, 3, 3])
