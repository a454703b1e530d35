"""Compile a Triton kernel for sm_90 on a machine without a GPU and count the SASS of its main loop.

No GPU needed: Triton compiles to a cubin for a named target, and its bundled cuobjdump lists the SASS and the
resource use (registers, spills). The instructions issued per weight element in the main loop bound a
decode GEMM that is issue-limited rather than HBM-limited (an H200 issues ~128 thread-instructions per SM
per clock; at 4.2 TB/s an SM must consume ~32 int4 or ~16 fp8 weights per clock, leaving ~4 or ~8).

    python3 packages/infer-backend-cuda/scripts/sass_census.py
prints, for the quantized GEMMs' decode configs and the BF16 skinny GEMM's one- and two-row tiles (with and
without the preloaded first step), registers, spill bytes and instructions per weight element (`FIXUP=1`: with the
split-K fix-up compiled in).
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from infer_backend_cuda.kernels import awq_gemm as A, awq_gemv as AV, fp8_gemm as F8, skinny_gemm as SK

_TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_OP = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,  # noqa: ANN001
                 divisible: tuple[str, ...] | None = None):
    """`divisible`: arguments marked divisible by 16, as Triton marks them at launch when they are (pointers,
    strides and sizes of the real shapes); without it loads are not vectorised and addresses cost more, and the
    register and instruction counts say little about the launched kernel (the fifteenth session's 254-register
    decode attention was such a compile: 128-152 launched). None: every pointer argument (a torch tensor's data
    is 16-byte aligned). Name the strides and sizes that are multiples of 16 at the real shapes too: they matter
    as much (the GDN Gram kernel: 255 registers and 336 B of spill with the pointers hinted, 142 and none with its
    strides as well)."""
    signature = dict(types) | {name: "constexpr" for name in constexprs}
    if divisible is None:
        divisible = tuple(name for name, kind in types.items() if kind.startswith("*"))
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_TOOL, flag, f.name], capture_output=True, text=True, check=True).stdout


def loop_census(kernel) -> tuple[str, int, collections.Counter]:  # noqa: ANN001 - a compiled kernel
    """(resource line, instructions in the longest backward branch's range, their opcode counts)."""
    cubin = kernel.asm["cubin"]
    resources = _cuobjdump(cubin, "--dump-resource-usage").splitlines()
    usage = next((line.strip() for line in resources if "REG" in line), "")
    lines = [line for line in _cuobjdump(cubin, "-sass").splitlines() if _ADDR.search(line)]
    addr = lambda line: int(_ADDR.search(line).group(1), 16)  # noqa: E731
    span = (0, -1)
    for line in lines:
        target = re.search(r"0x([0-9a-f]+)", line.split("BRA")[1]) if "BRA" in line else None
        start = int(target.group(1), 16) if target else addr(line)
        if start < addr(line) and addr(line) - start > span[1] - span[0]:  # a backward branch: a loop
            span = (start, addr(line))
    body = [line for line in lines if span[0] <= addr(line) <= span[1]]
    ops = collections.Counter(m.group(1).split(".")[0] for m in map(_OP.search, body) if m)
    return usage, len(body), ops


_AWQ_TYPES = dict(zip(
    ["x_ptr", "qw_ptr", "qz_ptr", "s_ptr", "b_ptr", "out_ptr", "ws_ptr", "counter_ptr", "M", "N", "K", "x_stride",
     "qw_stride", "qz_stride", "s_stride", "out_stride", "split_stride", "magic"],
    ["*bf16", "*i32", "*i32", "*fp16", "*fp16", "*bf16", "*fp32", "*i32"] + ["i32"] * 10))
_AWQ_GEMV_TYPES = dict(zip(
    ["x_ptr", "qw_ptr", "qz_ptr", "s_ptr", "b_ptr", "out_ptr", "ws_ptr", "counter_ptr", "M", "N", "x_stride",
     "qw_stride", "qz_stride", "s_stride", "out_stride", "split_stride", "groups", "groups_per_split", "magic"],
    ["*bf16", "*i32", "*i32", "*fp16", "*fp16", "*bf16", "*fp32", "*i32"] + ["i32"] * 11))
# Qwen3-4B's shapes: every pointer, N and the row strides are multiples of 16.
_AWQ_DIVISIBLE = ("x_ptr", "qw_ptr", "qz_ptr", "s_ptr", "b_ptr", "out_ptr", "ws_ptr", "counter_ptr", "N", "x_stride",
                  "qw_stride", "qz_stride", "s_stride", "out_stride", "split_stride")
# Qwen3-4B-FP8's shapes at one row: the pointers, N, K and the code and weight row strides are multiples of 16 (the
# scale strides, K's group count, are not).
_FP8_ROWS_DIVISIBLE = ("xq_ptr", "xs_ptr", "w_ptr", "ws_ptr", "row_ptr", "b_ptr", "out_ptr", "N", "K", "xq_stride",
                       "w_stride", "out_stride")
_SKINNY_TYPES = (dict.fromkeys(["x_ptr", "r_ptr", "nw_ptr", "r_out_ptr", "w_ptr", "b_ptr", "out_ptr"], "*bf16")
                 | dict.fromkeys(["M", "N", "K", "x_stride", "r_stride", "r_out_stride", "w_stride", "out_stride"], "i32")
                 | {"eps": "fp32"})
# Qwen3-4B's shapes: every pointer, N, K and the row strides are multiples of 16.
_SKINNY_DIVISIBLE = tuple(name for name in _SKINNY_TYPES if name not in ("M", "eps"))
# FIXUP=1 in the environment compiles the split-K fix-up (split_k.py) into the split kernels.
_FIXUP = os.environ.get("FIXUP", "0") == "1"


def _fp8_types(x: str, split: bool = False) -> dict[str, str]:
    """The row-streaming kernel's arguments, or with `split` the split-K kernel's (two more pointers)."""
    head = dict(zip(["xq_ptr", "xs_ptr", "w_ptr", "ws_ptr", "row_ptr", "b_ptr", "out_ptr"],
                    [x, "*fp32", "*fp8e4nv", "*fp32", "*i32", "*fp32", "*bf16"]))
    extra = {"part_ptr": "*fp32", "counter_ptr": "*i32"} if split else {}
    tail = dict.fromkeys(["M", "N", "K", "xq_stride", "xs_stride", "w_stride", "ws_stride", "out_stride"], "i32")
    return head | extra | tail


def cases():
    """(label, kernel, weight elements per program-step, threads) for the decode configs worth comparing."""
    # one row: the longest loop is one group (its K steps unrolled); 128 columns on 2 warps is the served config,
    # with its first group's loads before the wait (PRELOAD, awq_gemv._one_row_preloaded)
    for bn, warps, preload in ((128, 2, True), (128, 2, False), (256, 4, False), (512, 4, False)):
        ce = dict(GROUP=128, HAS_BIAS=False, PARTIAL=True, FIXUP=_FIXUP, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=8,
                  UNROLL=16, ROW_PROGRAMS=False, PRELOAD=preload, USE_PDL=preload)
        kernel = compile_sm90(AV._awq_gemv_kernel, _AWQ_GEMV_TYPES, ce, warps, 1, _AWQ_DIVISIBLE)
        yield f"awq gemv 1x{bn}x8 w{warps}{' preload' if preload else ''}", kernel, bn * 128, warps
    for bm, bn, bk, warps, stages in ((16, 128, 64, 4, 3), (16, 256, 64, 4, 3), (16, 128, 128, 4, 3),
                                      (16, 256, 128, 8, 3), (32, 128, 64, 4, 3), (64, 128, 64, 4, 3)):
        ce = dict(GROUP=128, HAS_BIAS=False, K_SPLIT=1024, PARTIAL=True, FIXUP=_FIXUP, DOT_F32=False,
                  SCALE_AFTER=bm <= A.SCALE_AFTER_MAX_M, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GATED=False,
                  USE_PDL=False)
        kernel = compile_sm90(A._awq_kernel, _AWQ_TYPES, ce, warps, stages, _AWQ_DIVISIBLE[:-1])
        yield f"awq {bm}x{bn}x{bk} w{warps}", kernel, bn * bk, warps
    for bm, bn, warps, stages, fuse in ((1, 64, 4, 2, True), (16, 64, 4, 3, False)):
        ce = dict(GROUP=128, HAS_BIAS=False, DOT_F32=False, SKINNY=bm <= 8, GROUPS_PER_SPLIT=8, PARTIAL=True,
                  FIXUP=_FIXUP, BLOCK_M=bm, BLOCK_N=bn, FUSE_QUANT=fuse, ROUND_IN_FP32=False, W_SCALE_UNIFORM=False,
                  USE_PDL=False)
        kernel = compile_sm90(F8._fp8_gemm_kernel, _fp8_types("*bf16" if fuse else "*fp8e4nv", True), ce, warps,
                              stages)
        yield f"fp8 gemm {bm}x{bn} w{warps}{' fused' if fuse else ''}", kernel, 128 * bn, warps
    # the row-streaming kernel at one row: 16-byte loads put every thread along K where groups * 128 >= 512 * warps
    # (and under PDL, the first weight tile asked for before the wait)
    for bn, groups, warps, uniform, pdl in ((4, 4, 2, False, False), (4, 4, 1, False, False), (4, 4, 1, True, False),
                                            (8, 4, 1, True, False), (8, 8, 2, True, False), (8, 2, 4, False, False),
                                            (4, 4, 1, True, True), (8, 4, 1, True, True)):
        ce = dict(GROUP=128, GROUPS_PER_STEP=groups, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=bn, EVEN=True,
                  W_SCALE_UNIFORM=uniform, USE_PDL=pdl)
        kernel = compile_sm90(F8._fp8_rows_kernel, _fp8_types("*fp8e4nv"), ce, warps, 1, _FP8_ROWS_DIVISIBLE)
        label = f"fp8 rows {bn}x{groups * 128} w{warps}{' uniform' if uniform else ''}{' pdl' if pdl else ''}"
        yield label, kernel, bn * groups * 128, warps


def skinny_cases():
    """The BF16 skinny GEMM's served forms at 1-2 rows under PDL (whole tiles), each plain and with PRELOAD."""
    for m, bn, bk, warps, rowwise, prologue in ((1, 4, 512, 2, True, 0), (1, 4, 1024, 4, False, 0),
                                                (1, 8, 512, 4, False, 1), (2, 4, 512, 2, True, 0),
                                                (2, 4, 256, 2, False, 0)):
        for preload in (False, True):
            ce = dict(PROLOGUE=prologue, HAS_RESIDUAL=prologue == 1, HAS_BIAS=False, BLOCK_M=m, BLOCK_N=bn,
                      BLOCK_K=bk, EVEN_K=True, USE_DOT=False, DOT_F32=False, PREFETCH=False, GATED=False, USE_PDL=True,
                      EVEN_N=True, ROWWISE=rowwise, PRELOAD=preload)
            kernel = compile_sm90(SK._skinny_gemm_kernel, _SKINNY_TYPES, ce, warps, 1, _SKINNY_DIVISIBLE)
            label = (f"skinny {m}x{bn}x{bk} w{warps}{' rowwise' if rowwise else ''}{' norm' if prologue else ''}"
                     f"{' preload' if preload else ''}")
            yield label, kernel, bn * bk, warps


def main() -> None:
    print(f"{'kernel':<34} {'instr/weight':>12}  resources; top opcodes of the main loop")
    for label, kernel, weights, warps in itertools.chain(cases(), skinny_cases()):
        usage, count, ops = loop_census(kernel)
        per_weight = count * warps * 32 / weights
        print(f"{label:<34} {per_weight:>12.2f}  {usage}\n{'':<48}{ops.most_common(8)}")


if __name__ == "__main__":
    main()
