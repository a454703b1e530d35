"""Quantized checkpoints in the exact published layouts, written from the specs independently of the production
unpacking code (round-to-nearest quantization of a dense HF model's linear weights).

AWQ (AutoAWQ "gemm", as Qwen/Qwen3-4B-AWQ): per linear `qweight` int32 `[in, out/8]`, `qzeros` int32
`[in/group, out/8]`, `scales` fp16 `[in/group, out]`; nibble i (bits 4i..4i+3) of each word holds column
`AWQ_ORDER[i]` of its group of eight columns. `pack_awq_reference` packs with Python ints, bit by bit, straight
from that sentence; the vectorised `pack_awq` (for real-size weights) is checked against it. No installable
independent packer fits: autoawq pins an old transformers and gptqmodel builds CUDA extensions.

Block FP8 (as Qwen/Qwen3-4B-FP8, DeepSeek-V3): `weight` float8_e4m3fn `[out, in]`, `weight_scale_inv`
`[ceil(out/bo), ceil(in/bi)]` with partial edge blocks; `w = weight * scale_inv` per block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # from the spec: the column of its eight that nibble i holds
FP8_MAX = 448.0
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def pack_awq_reference(codes: list[list[int]]) -> list[list[int]]:
    """Rows of 4-bit codes (column order) -> rows of signed int32 words, with Python ints."""
    words = []
    for row in codes:
        packed_row = []
        for base in range(0, len(row), 8):
            word = 0
            for nibble in range(8):
                word |= (row[base + AWQ_ORDER[nibble]] & 0xF) << (4 * nibble)
            packed_row.append(word - (1 << 32) if word >= 1 << 31 else word)
        words.append(packed_row)
    return words


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """Vectorised `pack_awq_reference`: int codes `[rows, cols]` -> int32 `[rows, cols/8]`."""
    c = codes.to(torch.int64)
    word = torch.zeros((c.shape[0], c.shape[1] // 8), dtype=torch.int64)
    for nibble, column in enumerate(AWQ_ORDER):
        word |= c[:, column::8] << (4 * nibble)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def quantize_awq(weight: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Asymmetric round-to-nearest of an HF `[out, in]` weight. Returns the AWQ tensors and the exact fp32
    dequantized `[out, in]` weight they stand for (the dense twin)."""
    w = weight.to(torch.float32).t()  # [in, out]
    rows, cols = w.shape
    grouped = w.reshape(rows // group, group, cols)
    lo, hi = grouped.amin(dim=1).clamp(max=0), grouped.amax(dim=1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-5).to(torch.float16)
    s = scales.to(torch.float32)
    zeros = (-lo / s).round().clamp(0, 15)
    codes = ((grouped / s[:, None, :]).round() + zeros[:, None, :]).clamp(0, 15)
    dequant = ((codes - zeros[:, None, :]) * s[:, None, :]).reshape(rows, cols)
    tensors = {
        "qweight": pack_awq(codes.reshape(rows, cols).to(torch.int32)),
        "qzeros": pack_awq(zeros.to(torch.int32)),
        "scales": scales,
    }
    return tensors, dequant.t().contiguous()


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-block amax scaling to e4m3 (edge blocks partial). Returns the tensors and the fp32 dequantized weight."""
    w = weight.to(torch.float32)
    out, cols = w.shape
    bo, bi = block
    rows_b, cols_b = -(-out // bo), -(-cols // bi)
    scale = torch.empty((rows_b, cols_b), dtype=torch.float32)
    for i in range(rows_b):
        for j in range(cols_b):
            amax = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].abs().max()
            scale[i, j] = amax / FP8_MAX if amax > 0 else 1.0
    scale = scale.to(scale_dtype).to(torch.float32)  # quantize against the scale as stored
    full = scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]
    codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale.to(scale_dtype)}, codes.to(torch.float32) * full


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def fp8_config(block: tuple[int, int]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def write_quantized(
    state: dict[str, torch.Tensor], config: dict, path: Path, quantization_config: dict, dtype: torch.dtype,
    twin_path: Path | None = None, fp8_scale_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write `state` (a dense HF state dict) quantized as `quantization_config` says into `path`, and, when asked,
    its dequantized twin as a dense checkpoint into `twin_path`. Other tensors are stored in `dtype`."""
    quantized, twin = {}, {}
    for name, tensor in state.items():
        if not LINEAR.match(name):
            quantized[name] = tensor.to(dtype).clone()  # clone: tied tensors share storage, which safetensors refuses
            twin[name] = tensor.to(dtype).clone()
            continue
        module = name.removesuffix(".weight")
        if quantization_config["quant_method"] == "awq":
            parts, dense = quantize_awq(tensor, quantization_config["group_size"])
        else:
            parts, dense = quantize_fp8_block(tensor, tuple(quantization_config["weight_block_size"]), fp8_scale_dtype)
        quantized.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        twin[name] = dense
    _save(path, quantized, {**config, "quantization_config": quantization_config})
    if twin_path is not None:
        _save(twin_path, twin, config)


def _save(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
