"""Prompts with images for the tiny Qwen3.5 checkpoints: pictures preprocessed by the server's own image processing
(equal to transformers' processor, tests/server/test_images.py), placed as the chat template and the server place
them (`<|vision_start|>`, the placeholders, `<|vision_end|>`), with the ids of `qwen3_5_vl_config`'s vision
tokens."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from infer_protocol.messages import ImageInput
from infer_server.image_processing import PreparedImage, preprocess
from infer_server.vision_spec import VisionSpec

IMAGE_PAD, VISION_START, VISION_END = 250, 251, 252
SPEC = VisionSpec(image_token_id=IMAGE_PAD, patch_size=16, temporal_patch_size=2, merge_size=2,
                  min_pixels=32 * 32, max_pixels=128 * 128, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def picture(width: int, height: int, seed: int) -> PreparedImage:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return preprocess(Image.fromarray(pixels, "RGB"), SPEC)


def text(length: int, seed: int) -> list[int]:
    return torch.randint(0, IMAGE_PAD, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def image_prompt(parts: list[list[int] | PreparedImage]) -> tuple[list[int], list[ImageInput]]:
    """Text and images in order; each image as the template writes it (start, placeholders, end)."""
    ids: list[int] = []
    images: list[ImageInput] = []
    for part in parts:
        if isinstance(part, list):
            ids += part
            continue
        ids.append(VISION_START)
        images.append(part.wire(len(ids)))
        ids += [IMAGE_PAD] * part.num_tokens + [VISION_END]
    return ids, images


def float_patches(image: ImageInput, values_per_channel: int) -> np.ndarray:
    """The float32 patches of a wire image, by numpy (the oracle of the worker's look-up on its device): the byte
    of column j is looked up in the row of channel j // values_per_channel."""
    patches = np.frombuffer(image.patches, dtype=np.uint8).reshape(image.shape)
    table = np.frombuffer(image.value_table, dtype=np.float32).reshape(-1, 256)
    return table[np.arange(image.shape[1]) // values_per_channel, patches]


ONE = [text(5, 1), picture(64, 64, 1), text(6, 2)]
TWO = [text(3, 3), picture(64, 96, 2), text(4, 4), picture(96, 64, 3), text(5, 5)]
