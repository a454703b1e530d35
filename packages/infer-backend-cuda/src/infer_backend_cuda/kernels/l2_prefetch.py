"""Weight prefetch into L2 across kernel boundaries, for the decode GEMMs.

Under programmatic dependent launch a kernel's programs are resident while the kernel before it still runs (they
wait in `gdc_wait` before reading its output). Weights are written by no kernel, so a program may ask for its whole
weight slice before that wait: one bulk prefetch (`cp.async.bulk.prefetch.L2.global`, Hopper's TMA unit, no
registers held) streams it into L2 while the norm or attention kernel before the GEMM leaves HBM idle, and the
GEMM's own loads then find it there. A hint: the hardware may drop it, and nothing is read from it.

`INFER_CUDA_L2_PREFETCH=0` turns it off (A/B runs). Read once at import, like the other INFER_CUDA_ switches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import interpreting, pdl_launch

ENV = "INFER_CUDA_L2_PREFETCH"
_WANTED = os.environ.get(ENV, "1").strip() != "0"
_ALIGN = 16  # the bulk copy's address and size granule


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Ask L2 for `nbytes` (a multiple of 16) from `ptr` (16-byte aligned), once per program (thread 0 issues it)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


def wanted(weight: torch.Tensor) -> bool:
    """Whether a kernel reading `weight` (rows contiguous) should prefetch its slices: on Hopper or later under PDL
    (without it the kernel starts after its producer anyway), not in the interpreter, with rows the bulk copy can
    address (16-byte aligned starts and lengths)."""
    if not _WANTED or interpreting() or weight.device.type != "cuda" or not pdl_launch(weight.device)["USE_PDL"]:
        return False
    elem = weight.element_size()
    return (weight.data_ptr() % _ALIGN == 0 and (weight.shape[-1] * elem) % _ALIGN == 0
            and (weight.stride(0) * elem) % _ALIGN == 0)
