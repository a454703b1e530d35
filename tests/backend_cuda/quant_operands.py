"""Quantized GEMM operands for the CUDA kernel tests: AWQ and block-FP8 weights quantized from seeded random values
through the checkpoint writers' own quantizers (tests/worker/quant_checkpoints.py), and seeded activations."""

from __future__ import annotations

import torch

from tests.worker.quant_checkpoints import quantize_awq, quantize_fp8_block

QWEN3_4B = ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728))  # (n, k) of qkv, o, gate_up, down


def awq_operands(n: int, k: int, group: int, device: str, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    tensors, _ = quantize_awq(w, group)
    return [tensors[name].to(device) for name in ("qweight", "qzeros", "scales")]


def fp8_operands(parts: list[int], k: int, block: tuple[int, int], device: str, seed: int = 0):
    """A fused FP8 weight of `parts` (each part its own, possibly partial, last block of scale rows)."""
    g = torch.Generator().manual_seed(seed)
    codes, scales, rows, first = [], [], [], 0
    for size in parts:
        tensors, _ = quantize_fp8_block(torch.randn(size, k, generator=g) * 0.05, block, torch.float32)
        codes.append(tensors["weight"])
        scales.append(tensors["weight_scale_inv"])
        rows.append(first + torch.arange(size, dtype=torch.int32) // block[0])
        first += scales[-1].shape[0]
    return torch.cat(codes).to(device), torch.cat(scales).to(device), torch.cat(rows).to(device)


def activations(m: int, k: int, dtype: torch.dtype, device: str, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)
