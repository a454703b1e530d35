"""The Qwen3.5 vision tower (transformers' `Qwen3_5VisionModel`): flattened image patches -> one embedding per
placeholder token.

- **Patch embedding**: the checkpoint's Conv3d has kernel = stride = (T, P, P) over `[C, T, P, P]` patches, so it
  is a linear layer over the flattened patch (its weight is a `[hidden, C*T*P*P]` view of the conv's).
- **Position embeddings**: a learned square table (`num_position_embeddings` = side x side) resampled bilinearly
  (align_corners) to each image's `(h, w)` patch grid, added to the patch embeddings.
- **Blocks**: pre-LayerNorm attention and MLP with residuals. Attention is bidirectional within each image (each
  image of a batch attends only to itself) with a 2-D rotary embedding: half of each head's rotary frequencies
  rotate with the patch's row, the other half with its column.
- **Patch merger**: LayerNorm, then each merge_size x merge_size block of patches (adjacent in the patch order,
  which is block-major: the server's patchify emits it so) is concatenated and projected by a 2-layer MLP to the
  text model's hidden size: one embedding per placeholder token.

The GEMMs go through the backend's linear ops; norms, activations, rotary and attention (torch SDPA) are torch ops:
the tower runs once per image at prefill, outside the decode graphs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from infer_core.ports.op_ports import OpPorts
from infer_worker.components.linear import Linear
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty, prefixed

LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any]) -> VisionConfig:
        """From config.json's `vision_config` (missing fields take Qwen3_5VisionConfig's defaults)."""
        c = vision_config
        rope = c.get("rope_parameters") or {}
        return cls(
            depth=int(c.get("depth", 27)),
            hidden_size=int(c.get("hidden_size", 1152)),
            intermediate_size=int(c.get("intermediate_size", 4304)),
            num_heads=int(c.get("num_heads", 16)),
            in_channels=int(c.get("in_channels", 3)),
            patch_size=int(c.get("patch_size", 16)),
            temporal_patch_size=int(c.get("temporal_patch_size", 2)),
            spatial_merge_size=int(c.get("spatial_merge_size", 2)),
            out_hidden_size=int(c.get("out_hidden_size", 3584)),
            num_position_embeddings=int(c.get("num_position_embeddings", 2304)),
            hidden_act=str(c.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        )

    @property
    def values_per_channel(self) -> int:
        """A patch's values of one channel (T * P * P): a flattened patch is channel major."""
        return self.temporal_patch_size * self.patch_size**2

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.values_per_channel

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def _activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {name!r} is not supported (one of {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class LayerNorm:
    def __init__(self, size: int, dtype: torch.dtype, device: str) -> None:
        self.weight = empty((size,), dtype, device)
        self.bias = empty((size,), dtype, device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, LAYER_NORM_EPS)

    def weight_slots(self) -> WeightSlots:
        return {"weight": WeightSlot(self.weight, WeightInit.ONES), "bias": WeightSlot(self.bias, WeightInit.ZEROS)}


def _linear(ops: OpPorts, in_features: int, out_features: int, dtype: torch.dtype, device: str) -> Linear:
    return Linear.allocate(ops, in_features, out_features, True, dtype, device)


def _slots(**parts: Linear | LayerNorm) -> WeightSlots:
    return {name: slot for prefix, part in parts.items() for name, slot in prefixed(f"{prefix}.",
                                                                                     part.weight_slots()).items()}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention:
    def __init__(self, ops: OpPorts, config: VisionConfig, dtype: torch.dtype, device: str) -> None:
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.qkv = _linear(ops, d, 3 * d, dtype, device)
        self.proj = _linear(ops, d, d, dtype, device)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [N, H, D] each
        q, k = (self._rotate(t, cos, sin) for t in (q, k))
        outs = [  # one image attends to itself only: SDPA per image, [1, H, L, D]
            F.scaled_dot_product_attention(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None])
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]
        out = torch.cat([o[0].transpose(0, 1) for o in outs]).reshape(n, -1)
        return self.proj(out)

    @staticmethod
    def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # in float32, as transformers does, whatever the model dtype
        f = t.float()
        return (f * cos[:, None] + _rotate_half(f) * sin[:, None]).to(t.dtype)

    def weight_slots(self) -> WeightSlots:
        return _slots(qkv=self.qkv, proj=self.proj)


class VisionBlock:
    def __init__(self, ops: OpPorts, config: VisionConfig, dtype: torch.dtype, device: str) -> None:
        self.norm1 = LayerNorm(config.hidden_size, dtype, device)
        self.norm2 = LayerNorm(config.hidden_size, dtype, device)
        self.attn = VisionAttention(ops, config, dtype, device)
        self.linear_fc1 = _linear(ops, config.hidden_size, config.intermediate_size, dtype, device)
        self.linear_fc2 = _linear(ops, config.intermediate_size, config.hidden_size, dtype, device)
        self.act = _activation(config.hidden_act)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.linear_fc2(self.act(self.linear_fc1(self.norm2(x))))

    def weight_slots(self) -> WeightSlots:
        return {**_slots(norm1=self.norm1, norm2=self.norm2), **prefixed("attn.", self.attn.weight_slots()),
                **prefixed("mlp.", _slots(linear_fc1=self.linear_fc1, linear_fc2=self.linear_fc2))}


class PatchMerger:
    def __init__(self, ops: OpPorts, config: VisionConfig, dtype: torch.dtype, device: str) -> None:
        merged = config.hidden_size * config.spatial_merge_size**2
        self.merged = merged
        self.norm = LayerNorm(config.hidden_size, dtype, device)
        self.linear_fc1 = _linear(ops, merged, merged, dtype, device)
        self.linear_fc2 = _linear(ops, merged, config.out_hidden_size, dtype, device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged))))

    def weight_slots(self) -> WeightSlots:
        return _slots(norm=self.norm, linear_fc1=self.linear_fc1, linear_fc2=self.linear_fc2)


def _block_major(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column), in the patch order: merge x merge blocks row-major, row-major within a block."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()


class VisionTower:
    """`model.visual.*` of a Qwen3.5 checkpoint."""

    def __init__(self, ops: OpPorts, config: VisionConfig, dtype: torch.dtype, device: str) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.patch_embed = _linear(ops, config.patch_dim, config.hidden_size, dtype, device)
        self.pos_embed = empty((config.num_position_embeddings, config.hidden_size), dtype, device)
        self.side = int(config.num_position_embeddings**0.5)
        self.blocks = [VisionBlock(ops, config, dtype, device) for _ in range(config.depth)]
        self.merger = PatchMerger(ops, config, dtype, device)
        spatial = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.config.spatial_merge_size**2

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """Patches `[sum t*h*w, C*T*P*P]` of the images, in order -> `[sum num_tokens, out_hidden_size]`."""
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grid_thw):
            raise ValueError(f"{pixel_values.shape[0]} patches for the grids {list(grid_thw)}")
        rows, cols = self._positions(grid_thw)
        x = self.patch_embed(pixel_values.to(self.dtype)) + self._position_embeddings(rows, cols, grid_thw)
        angles = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)  # [N, head_dim]: the row half, the column half, twice
        cos, sin = angles.cos(), angles.sin()
        lengths = [h * w for t, h, w in grid_thw for _ in range(t)]  # each frame attends to itself
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def _positions(self, grid_thw: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = [], []
        for t, h, w in grid_thw:
            r, c = _block_major(h, w, self.config.spatial_merge_size, torch.device(self.device))
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        return torch.cat(rows).float(), torch.cat(cols).float()

    def _position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor,
                             grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        heights = torch.cat([torch.full((t * h * w,), h, device=rows.device) for t, h, w in grid_thw])
        widths = torch.cat([torch.full((t * h * w,), w, device=rows.device) for t, h, w in grid_thw])
        side = self.side
        src_r = rows * (side - 1) / (heights - 1).clamp(min=1)
        src_c = cols * (side - 1) / (widths - 1).clamp(min=1)
        taps_r, w_r = _taps(src_r, side)
        taps_c, w_c = _taps(src_c, side)
        index = (taps_r[:, :, None] * side + taps_c[:, None, :]).reshape(-1, 4)
        weight = (w_r[:, :, None] * w_c[:, None, :]).reshape(-1, 4)
        # in float32, as transformers does, whatever the model dtype
        return (self.pos_embed[index].float() * weight[:, :, None]).sum(1).to(self.dtype)

    def weight_slots(self) -> WeightSlots:
        c = self.config
        conv = self.patch_embed.weight.view(c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size,
                                            c.patch_size)
        slots: WeightSlots = {
            "patch_embed.proj.weight": WeightSlot(conv, WeightInit.NORMAL),
            "patch_embed.proj.bias": WeightSlot(self.patch_embed.weight_slots()["bias"].tensor, WeightInit.ZEROS),
            "pos_embed.weight": WeightSlot(self.pos_embed, WeightInit.NORMAL),
            **prefixed("merger.", self.merger.weight_slots()),
        }
        for i, block in enumerate(self.blocks):
            slots.update(prefixed(f"blocks.{i}.", block.weight_slots()))
        return slots


def _taps(src: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table entries a source coordinate reads and their bilinear weights (clamped at the border)."""
    floor = src.floor()
    offsets = torch.arange(2, device=src.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
