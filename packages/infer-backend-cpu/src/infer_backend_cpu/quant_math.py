"""The reference numerics of the quantized layouts, one torch expression per step of the definition.

AWQ (W4A16): `w[in, out] = (q - z) * s`, dequantized exactly in fp32 (a 4-bit difference times an fp16 scale fits
fp32's mantissa), then an ordinary GEMM in the activation dtype.

Block FP8 (W8A8): activations are quantized per token and per `group` columns at run time (scale = amax / 448,
1 where amax is 0, codes = (x / scale) clamped to ±448 and rounded to e4m3), then
`y = sum_g (x_q[:, g] @ w_q[:, g].T) * x_scale[:, g] * w_scale[:, g]` accumulated in fp32. The CUDA kernels
compute the same sum; only the order of the additions inside one group differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer_core.quant import AWQ_PACK, FP8_E4M3_MAX

# Nibble i of an AutoAWQ word holds column AWQ_ORDER[i] of its eight; column c sits in nibble AWQ_REVERSE[c].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[rows, cols/8]` -> the 4-bit codes `[rows, cols]` (int32, 0..15) in column order."""
    shifts = torch.tensor([4 * n for n in AWQ_REVERSE], dtype=torch.int32, device=packed.device)
    codes = (packed[:, :, None] >> shifts) & 0xF  # arithmetic shift: the mask drops the sign bits
    return codes.reshape(packed.shape[0], packed.shape[1] * AWQ_PACK)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 `w [in, out] = (q - z) * s`, each zero point and scale shared by `in / groups` consecutive rows."""
    group = qweight.shape[0] // scales.shape[0]
    codes = awq_unpack(qweight).to(torch.float32)
    zeros = awq_unpack(qzeros).to(torch.float32).repeat_interleave(group, dim=0)
    return (codes - zeros) * scales.to(torch.float32).repeat_interleave(group, dim=0)


def quantize_activation_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [T, K]` -> (e4m3 codes `[T, K]`, fp32 scales `[T, ceil(K / group)]`); a partial last group scales alone."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = F.pad(x.to(torch.float32), (0, groups * group - cols)).view(rows, groups, group)
    amax = padded.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    codes = (padded / scale[:, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(rows, groups * group)[:, :cols], scale


def fp8_block_dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, scale_row: torch.Tensor, group: int
) -> torch.Tensor:
    """fp32 `w [out, in] = weight * scale_inv` per block (for checks; the GEMM below never materialises it)."""
    per_row = scale_inv.to(torch.float32)[scale_row.long()]  # [out, in-blocks]
    return weight.to(torch.float32) * per_row.repeat_interleave(group, dim=1)[:, : weight.shape[1]]


def fp8_grouped_codes(weight: torch.Tensor, group: int) -> torch.Tensor:
    """e4m3 codes `[N, K]` -> fp32 `[groups, group, N]` (zero-padded): each group's GEMM operand, contiguous."""
    cols = weight.shape[1]
    groups = -(-cols // group)
    padded = F.pad(weight.to(torch.float32), (0, groups * group - cols))
    return padded.view(weight.shape[0], groups, group).permute(1, 2, 0).contiguous()


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    scale_row: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    grouped: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 `x [T, K] @ w.T` with `weight` the e4m3 codes `[N, K]`, `scale_inv [rows, ceil(K / group)]` and
    `scale_row [N]`; `grouped` is `fp8_grouped_codes(weight, group)` when the caller keeps it."""
    cols = x.shape[1]
    codes, x_scale = quantize_activation_fp8(x, group)
    w = fp8_grouped_codes(weight, group) if grouped is None else grouped
    w_scale = scale_inv.to(torch.float32)[scale_row.long()]  # [N, groups]
    out = torch.zeros((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    for g, start in enumerate(range(0, cols, group)):
        end = min(start + group, cols)
        partial = codes[:, start:end].to(torch.float32) @ w[g, : end - start]
        out += partial * (x_scale[:, g, None] * w_scale[None, :, g])
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(x.dtype)
