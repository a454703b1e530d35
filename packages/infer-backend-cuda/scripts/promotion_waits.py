"""Where Triton waits for the block-FP8 mid GEMM's fp8 MMAs, compiled for sm_90 on a machine without a GPU.

The kernel promotes each 128-deep group's product into its fp32 sum (`acc += product * scales`). Unless the wait for a
group's `warp_group_dot` leaves later MMAs in flight (`pendings > 0`), the tensor cores idle while the CUDA cores
scale, and the kernel is compute-bound far above its weight bytes (docs/benchmarks.md, twentieth session: gate_up at
128 rows 35 us for 50 MB on the H100). Triton 3.9 gives `pendings = 0` after every dot. Re-run this after a Triton
upgrade:

    PYTHONPATH=packages/infer-backend-cuda/scripts uv run python packages/infer-backend-cuda/scripts/promotion_waits.py
"""

from __future__ import annotations

import re

import triton

from infer_backend_cuda.kernels import mid_gemm as G
from sass_census import compile_sm90

POINTERS = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
            "counter_ptr": "*i32", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "row_ptr": "*i32"}
DIVISIBLE = ("x_stride", "w_stride", "out_stride", "K", "N", "k_per_split")


def main() -> None:
    fn = G._mid_gemm_kernel
    for uniform in (False, True):
        constexprs = dict(HAS_BIAS=False, PARTIAL=False, FIXUP=False, GATED=False, BLOCK_M=128, BLOCK_N=64,
                          BLOCK_K=128, EVEN_K=True, DOT_F32=False, BLOCK_SCALED=True, W_SCALE_UNIFORM=uniform,
                          USE_PDL=False)
        types = {p.name: POINTERS.get(p.name, "i32") for p in fn.params if p.name not in constexprs}
        kernel = compile_sm90(fn, types, constexprs, 4, 4,
                              divisible=tuple(n for n, t in types.items() if t.startswith("*")) + DIVISIBLE)
        waits = re.findall(r"warp_group_dot_wait .*?pendings = (\d+)", kernel.asm["ttgir"])
        dots = len(re.findall(r"ttng\.warp_group_dot ", kernel.asm["ttgir"]))
        print(f"triton {triton.__version__}, W_SCALE_UNIFORM={uniform}: {dots} fp8 dot(s) in the loop, waits with "
              f"pendings {waits}")


if __name__ == "__main__":
    main()
