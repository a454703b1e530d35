"""Helpers shared by the Triton launchers (no triton import here)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache

import torch

# INFER_CUDA_PDL=0 launches every kernel without programmatic dependent launch (A/B benchmarks, debugging).
# Not under RUSTINFER_: that prefix is the config loader's, which refuses names it does not know.
PDL_ENV = "INFER_CUDA_PDL"
_PDL_WANTED = os.environ.get(PDL_ENV, "1").strip() != "0"


def on_off_switch(environ: Mapping[str, str], name: str, on: str, off: str) -> bool | None:
    """An `INFER_CUDA_` switch of two values: 1 -> True, 0 -> False, unset or empty -> None; anything else is refused,
    naming what `on` (1) and `off` (0) mean."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 1 ({on}) or 0 ({off})")
    return raw == "1"


def count_switch(environ: Mapping[str, str], name: str, default: int, lowest: int, highest: int | None,
                 expected: str) -> int:
    """An `INFER_CUDA_` switch holding a whole number from `lowest` (to `highest`): unset or empty -> `default`;
    anything else is refused, saying what was `expected`."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < lowest or (highest is not None and int(raw) > highest):
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return int(raw)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, the CI mode)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "no")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether `tl.dot` operands are upcast to fp32 (and multiplied in IEEE fp32).

    On the GPU bf16/fp16 operands go to the tensor cores as they are, accumulating in fp32 (as every
    production attention kernel does); fp32 inputs use ``input_precision="ieee"`` (no TF32) so an fp32 run
    matches the CPU reference closely. Triton's interpreter (3.9) multiplies bf16 operands as their raw
    uint16 bit patterns, so under the interpreter every dot is done in fp32.
    """
    return dtype == torch.float32 or interpreting()


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {t.stride(-1)})")


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 2-D `[rows, last]` tensor (a view when possible) with a contiguous last dimension."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1])


def norm_num_warps(block: int) -> int:
    if block <= 512:
        return 2
    if block <= 2048:
        return 4
    if block <= 8192:
        return 8
    return 16


@lru_cache(maxsize=None)
def _pdl_supported(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        import triton.language.extra.cuda as triton_cuda
    except ImportError:
        return False
    return hasattr(triton_cuda, "gdc_wait")


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch options for a kernel with a `USE_PDL` constexpr: programmatic dependent launch on Hopper+.

    With PDL a kernel's programs may be scheduled while the kernel before it on the stream is still finishing
    (each program signals `gdc_launch_dependents` at once, then `gdc_wait`s for its producer before touching
    any tensor), which hides the launch-and-ramp gap between the many small kernels of a decode step. It
    composes with CUDA-graph capture, and kernels launched without it (cuBLAS, torch, Numba) order as usual.
    """
    if _PDL_WANTED and device.type == "cuda" and not interpreting() and _pdl_supported(device.index or 0):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


# What one program of a kernel holds on an SM besides its registers and shared memory (sm_80-sm_90): registers are
# given to a warp in units of 256, each resident program also keeps 1 KB of shared memory for the runtime, and an
# SM holds at most 32 programs.
REG_UNIT, SHARED_RESERVED, MAX_PROGRAMS_PER_SM = 256, 1024, 32


def resident_programs(n_regs: int, num_warps: int, shared_bytes: int, regs_per_sm: int, shared_per_sm: int,
                      threads_per_sm: int) -> int:
    """How many programs of a compiled kernel one SM runs at once (its occupancy), the least of what its registers,
    shared memory, threads and the program limit allow: a grid of more than `SMs x this` programs runs in more
    than one wave."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // REG_UNIT) * REG_UNIT
    by_regs = regs_per_sm // regs_per_warp // num_warps
    by_shared = shared_per_sm // (shared_bytes + SHARED_RESERVED)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(0, min(by_regs, by_shared, by_threads, MAX_PROGRAMS_PER_SM))
