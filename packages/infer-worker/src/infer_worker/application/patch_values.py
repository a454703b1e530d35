"""The vision tower's float32 patches from the wire's uint8 ones: each byte looked up in its channel's row of the
image's value table (the server's rescale and normalize of the 256 byte values), on the worker's device. A gather
copies table entries, so the patches are the processor's float32 bit for bit, and the wire carries a quarter of
the bytes (the host-to-device copy too)."""

from __future__ import annotations

import functools

import torch

from infer_protocol.messages import ImageInput
from infer_worker.components.vision import VisionConfig

_FLOAT32_BYTES = 4


def check_patches(image: ImageInput, config: VisionConfig) -> None:
    """ValueError unless the image's bytes are `shape` uint8 patches of the tower's width and a table per channel."""
    rows, columns = image.shape
    if columns != config.patch_dim or len(image.patches) != rows * columns:
        raise ValueError(f"{len(image.patches)} patch bytes of shape {tuple(image.shape)} for patches of "
                         f"{config.patch_dim} values")
    if len(image.value_table) != config.in_channels * 256 * _FLOAT32_BYTES:
        raise ValueError(f"a value table of {len(image.value_table)} bytes for {config.in_channels} channels "
                         "of 256 float32 values")


@functools.lru_cache(maxsize=8)
def _channel_of_column(columns: int, values_per_channel: int, device: torch.device) -> torch.Tensor:
    """`[1, columns]` int32: the channel of each patch column (a row is channel major: C, then T, P, P)."""
    return (torch.arange(columns, dtype=torch.int32) // values_per_channel).view(1, -1).to(device)


def patch_values(image: ImageInput, values_per_channel: int, device: torch.device | str) -> torch.Tensor:
    """`[rows, C*T*P*P]` float32 on `device`: the image's patches (checked by `check_patches`) looked up;
    `values_per_channel` = T*P*P."""
    device = torch.device(device)
    patches = torch.frombuffer(bytearray(image.patches), dtype=torch.uint8).view(image.shape)
    table = torch.frombuffer(bytearray(image.value_table), dtype=torch.float32).view(-1, 256)
    patches, table = patches.to(device, non_blocking=True), table.to(device, non_blocking=True)
    return table[_channel_of_column(image.shape[1], values_per_channel, device), patches.int()]
