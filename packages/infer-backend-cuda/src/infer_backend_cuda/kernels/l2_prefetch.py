"""Asking L2 for the weight the next kernel streams, from a kernel that leaves HBM idle.

At decode batch sizes the attention between a layer's qkv and o_proj GEMMs is a chain of dependent round trips
(~8 us a Qwen3-4B layer at one row for ~1 MB of keys) during which HBM has nothing to stream. Its programs can
ask L2 for the o_proj weight meanwhile (`cp.async.bulk.prefetch.L2.global`: Hopper's TMA unit, fire and forget,
no registers held), each a slice of it, so that the GEMM after it finds its stream in L2. A hint: the hardware
may drop it and nothing is read from it, so values never change.

Only where the prefetched bytes fit well inside L2 and the kernel issuing them is latency-bound: the tenth
session's form, every skinny GEMM prefetching its own slice before its wait (the 100 MB gate / up weight
included), made the step 0.53 ms slower (docs/benchmarks.md).

`INFER_CUDA_L2_PREFETCH`: `1` (default) the programs issue their slice after waiting on the producer (the qkv
GEMM's stream is done), `early` before it, `0` never (A/B runs). Read once at import, like the other INFER_CUDA_
switches.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_backend_cuda.kernels._common import interpreting, pdl_launch

ENV = "INFER_CUDA_L2_PREFETCH"
OFF, AFTER_WAIT, EARLY = 0, 1, 2
_MODES = {"0": OFF, "1": AFTER_WAIT, "early": EARLY}
MODE = _MODES.get(os.environ.get(ENV, "1").strip().lower(), AFTER_WAIT)
MAX_ROWS = 8  # decode batches up to this size: the attention is latency-bound there
MAX_BYTES = 32 << 20  # well inside the H100 / H200's 50 MB L2, beside the running kernels' own traffic
_ALIGN = 16  # the bulk prefetch's address and size granule


class L2Prefetch(NamedTuple):
    """Bytes `[0, total)` of `base` (a uint8 view), program i asking for `[i * chunk, (i + 1) * chunk)`."""

    base: torch.Tensor
    chunk: int
    total: int
    mode: int


def plan(tensor: torch.Tensor | None, rows: int, num_programs: int) -> L2Prefetch | None:
    """How `num_programs` programs of a kernel over `rows` rows split `tensor` among them, or None where no
    prefetch is issued: switched off, not a Hopper-class GPU under PDL, the interpreter, above `MAX_ROWS` rows, a
    tensor larger than `MAX_BYTES` or one the bulk prefetch cannot address (not contiguous, not 16-byte aligned)."""
    if (tensor is None or MODE == OFF or rows > MAX_ROWS or interpreting() or tensor.device.type != "cuda"
            or not pdl_launch(tensor.device)["USE_PDL"] or not tensor.is_contiguous()
            or tensor.data_ptr() % _ALIGN):
        return None
    total = tensor.numel() * tensor.element_size() // _ALIGN * _ALIGN
    if not 0 < total <= MAX_BYTES:
        return None
    chunk = triton.cdiv(triton.cdiv(total, max(1, num_programs)), _ALIGN) * _ALIGN
    return L2Prefetch(tensor.reshape(-1).view(torch.uint8), chunk, total, MODE)


@triton.jit
def prefetch_slice(base_ptr, chunk, total, index):
    """Program `index`'s slice of `plan`'s bytes into L2 (thread 0 issues one bulk prefetch; empty past the end)."""
    start = index.to(tl.int64) * chunk
    size = tl.minimum(chunk, total - start)
    if size > 0:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base_ptr + start, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
