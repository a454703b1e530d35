"""Block FP8 GEMMs through cuBLASLt's DeepSeek recipe (`torch._scaled_mm`: 1x128 activation and 128x128 weight
scales, Hopper only), for the row counts where the Triton tiles cannot fill the GPU.

The recipe exists from torch 2.9 (cuBLAS >= 12.9, sm90 only; `_check_deepseek_support`). `torch._scaled_mm`
infers it from the scales' shapes and strides:
- `a` e4m3 `[M, K]` row-major, `b` e4m3 `[K, N]` column-major (the `[N, K]` weight's `.t()`), K and N multiples of
  16;
- `scale_a` fp32 `[M, ceil(K/128)]` with strides `(1, M)` (M-major), the decode scales (amax / 448) as our
  quantization kernel makes them;
- `scale_b` fp32 `[L4, ceil(N/128)]`, strides `(1, L4)`, L4 = ceil(K/128) rounded up to 4 (cuBLASLt reads that
  padding; torch's checks before pytorch#166752, late 2025, took the unpadded stride and gave silent wrong results
  where L % 4 != 0): the `weight_scale_inv [ceil(N/128), L]`'s `.t()` when L % 4 == 0, so this path takes
  K % 512 == 0 only, where every torch version agrees;
- `use_fast_accum` stays False (the MMA's partial sums promoted to fp32, as the Triton kernel does per group);
- out bf16 / fp16 / fp32 and a bias only in a 16-bit output dtype; this path takes bf16 / fp16 inputs (the
  probe's).
vLLM's torch backend pads M to a multiple of 4 (the M-major scale rows must be 16-byte aligned); so does this one,
with rows the quantization kernel fills with zeros. Rows of a GEMM are independent, so the padding changes
nothing in the real ones.

Used only where the weight's scale blocks are the regular 128x128 grid (`scale_row[n] == n // 128`: every fused
part a whole number of blocks, as in Qwen3's qkv and gate_up) and only after `available` has compared one small
GEMM against the Triton kernel on this device: a torch without the recipe, a non-Hopper GPU or a cuBLAS that
answers wrongly leaves the Triton path in place. `INFER_CUDA_FP8_SCALED_MM=0` switches it off (A/B runs).
cuBLAS calls are captured into CUDA graphs as the BF16 linears' are (`F.linear`); the output is `torch.empty`
from the graph pool under capture.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Callable

import torch

from infer_backend_cuda.kernels._common import interpreting

ENV = "INFER_CUDA_FP8_SCALED_MM"
_WANTED = os.environ.get(ENV, "1").strip() != "0"
BLOCK = 128
ROW_PAD = 4
_log = logging.getLogger(__name__)

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_probed: dict[int, bool] = {}
_regular: dict[int, tuple[weakref.ref, bool]] = {}


def padded_rows(m: int) -> int:
    return -(-m // ROW_PAD) * ROW_PAD


def shape_fits(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, group: int,
               bias: torch.Tensor | None) -> bool:
    """Whether the operands have the recipe's layout (host metadata only; the scale rows are `regular_blocks`)."""
    n, k = weight.shape
    blocks = -(-k // BLOCK)
    return (
        group == BLOCK and k % (4 * BLOCK) == 0 and n % 16 == 0
        and x.dtype in (torch.bfloat16, torch.float16) and (bias is None or bias.dtype == x.dtype)
        and tuple(scale_inv.shape) == (-(-n // BLOCK), blocks) and scale_inv.dtype == torch.float32
        and scale_inv.stride() == (blocks, 1) and weight.stride() == (k, 1)
    )


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def regular_blocks(scale_row: torch.Tensor) -> bool:
    """`scale_row[n] == n // 128` for every row, checked once per tensor (a host copy: never under capture, where
    an unchecked weight answers False and keeps the Triton kernel)."""
    entry = _regular.get(id(scale_row))
    if entry is not None and entry[0]() is scale_row:
        return entry[1]
    if scale_row.is_cuda and _capturing():
        return False
    rows = torch.arange(scale_row.shape[0], dtype=torch.int64) // BLOCK
    ok = bool(torch.equal(scale_row.detach().cpu().to(torch.int64), rows))
    _regular[id(scale_row)] = (weakref.ref(scale_row, lambda _, key=id(scale_row): _regular.pop(key, None)), ok)
    return ok


def block_linear(codes: torch.Tensor, x_scale_t: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                 out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """`codes [Mp, K]` (Mp a multiple of ROW_PAD) and `x_scale_t [ceil(K/128), Mp]` (contiguous: its `.t()` is the
    M-major scale) times the weight -> `[Mp, N]`, into `out` when given."""
    kwargs = dict(scale_a=x_scale_t.t(), scale_b=scale_inv.t(), bias=bias, out_dtype=out_dtype)
    if out is not None:
        return torch._scaled_mm(codes, weight.t(), **kwargs, out=out)
    return torch._scaled_mm(codes, weight.t(), **kwargs)


def available(device: torch.device, scaled: Gemm, reference: Gemm) -> bool:
    """Whether this device runs the recipe and agrees with the Triton kernel: `scaled` and `reference` each map
    (x, weight, scale_inv, scale_row) to the GEMM's output, on one small problem with a padded row count and
    three 128-blocks of rows. Probed once per device, outside graph capture (it synchronises); any exception or
    disagreement answers False for good."""
    if not _WANTED or device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _probed:
        return _probed[index]
    if _capturing():
        return False
    ok = False
    try:
        if torch.cuda.get_device_capability(index)[0] == 9 and hasattr(torch, "_scaled_mm"):
            ok = _agrees(torch.device("cuda", index), scaled, reference)
    except Exception as exc:  # noqa: BLE001 - any failure of the library keeps the Triton kernel
        _log.info("FP8 block GEMM: torch._scaled_mm unusable here (%s: %s); the Triton kernel stays",
                  type(exc).__name__, exc)
    _probed[index] = ok
    return ok


def _agrees(device: torch.device, scaled: Gemm, reference: Gemm) -> bool:
    g = torch.Generator(device="cpu").manual_seed(0)
    m, n, k = 70, 3 * BLOCK, 4 * BLOCK
    x = torch.randn((m, k), generator=g).to(device=device, dtype=torch.bfloat16)
    weight = (torch.randn((n, k), generator=g) * 64).clamp(-448, 448).to(device=device, dtype=torch.float8_e4m3fn)
    scale_inv = (torch.rand((n // BLOCK, k // BLOCK), generator=g) * 1e-3 + 1e-4).to(device)
    scale_row = (torch.arange(n, dtype=torch.int32) // BLOCK).to(device)
    want = reference(x, weight, scale_inv, scale_row).float()
    got = scaled(x, weight, scale_inv, scale_row).float()
    # The same fp32 sums in another order, rounded to bf16: a few bf16 ulps at most.
    ok = got.shape == want.shape and bool(((got - want).abs() <= 1e-2 * want.abs() + 1e-3 * want.abs().max()).all())
    if not ok:
        _log.info("FP8 block GEMM: torch._scaled_mm disagrees with the Triton kernel; the Triton kernel stays")
    return ok
