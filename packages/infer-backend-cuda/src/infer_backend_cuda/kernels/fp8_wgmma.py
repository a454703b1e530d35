"""Block FP8 (W8A8) GEMM for 8-128 rows in Gluon, whose fp8 MMAs overlap their promotion (Hopper only).

`y[m, n] = sum_g (codes[m, g] . weight[n, g]) * x_scale[m, g] * scale_inv[row(n), g]`, the numerics of
`fp8_gemm.fp8_block_linear` and `mid_gemm`'s BLOCK_SCALED program: each 128-column group's fp8 product summed in fp32
by the tensor cores, then scaled by both scales into an fp32 accumulator (the promotion).

Why Gluon: Triton's pipeliner waits for every fp8 `tl.dot` before the FFMAs that promote it (`warp_group_dot_wait
{pendings = 0}` after each dot, in every form tried; `scripts/promotion_waits.py`), so at 96-128 rows the tensor
cores idle while the promotion runs and the mid GEMM is compute-bound far above its weight bytes (gate_up at 128
rows: 35 us on an H100 for 50 MB). Here the loop issues group g's wgmma, then waits with one group still in flight
(`warpgroup_mma_wait(num_outstanding=1)`, DeepGEMM's `wgmma.wait_group 1`) and promotes group g - 1 while group g runs.

Weight-left: one program takes BLOCK_N weight rows (the wgmma M side, 64 a warpgroup) against all M <= 128 token
rows (the wgmma N side), so each weight byte is read once. Operands arrive by TMA into a ring of STAGES slots, each
slot refilled as soon as the wgmma that read it has retired. Each BLOCK_N-row tile must lie in one 128-row scale block
(`uniform_tiles`): its weight scale is one value a group. No split-K: for the narrow outputs (N = 2560: 40 tiles of 64
on 132 SMs) this kernel is not the one to use; the tuner decides where it wins.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GROUP = 128  # the block-FP8 scale group along K, one wgmma K step of the loop
_GROUP = gl.constexpr(GROUP)
# The TMA load's name: `async_copy_global_to_shared` in Triton 3.6 (the device image), `async_load` since (3.9 removed
# the old name).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
MAX_ROWS = 128  # token rows: one wgmma N side
BLOCK_N = 64  # weight rows a program: one warpgroup's wgmma M side, inside one 128-row scale block


@gluon.jit
def _fp8_wgmma_kernel(w_desc, x_desc, xs_ptr, ws_ptr, scale_row_ptr, out_ptr, M, N, G, xs_stride, ws_stride,
                      out_stride, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    off_n = gl.program_id(0) * BLOCK_N
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, _GROUP], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, _GROUP], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    stage_bytes: gl.constexpr = (BLOCK_N + BLOCK_M) * _GROUP  # fp8: one byte an element
    for i in gl.static_range(STAGES):  # the host checks G >= STAGES
        mbarrier.expect(ready.index(i), stage_bytes)
        _tma_load(w_desc, [off_n, i * _GROUP], ready.index(i), w_smem.index(i))
        _tma_load(x_desc, [0, i * _GROUP], ready.index(i), x_smem.index(i))

    # 4 warps (one warpgroup) cover the 64 weight rows; at 128 token rows two warpgroups take half the rows each,
    # so that the three accumulator-sized values live at the wait (the sum, the group retiring, the group in
    # flight) fit the registers (one warpgroup: 255 registers and 296 bytes of spill, compiled for sm_90).
    warps_n: gl.constexpr = num_warps // 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps_n],
                                                  instr_shape=[16, BLOCK_M // warps_n, 32])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    row_ok = rows < M
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    w_scales = ws_ptr + gl.load(scale_row_ptr + off_n) * ws_stride  # this tile's row of weight scales

    # Each group's scales are loaded an iteration before its promotion: a load's latency (~0.5 us from L2) in
    # every iteration made the loop latency-bound (the first H100 run: ~0.45 us a group at 16 rows).
    scale_next = gl.load(xs_ptr + rows * xs_stride, mask=row_ok, other=0.0) * gl.load(w_scales)
    mbarrier.wait(ready.index(0), 0)
    # use_acc=False: the zeros only name the registers the wgmma writes (made where used, so none stay live)
    prev = warpgroup_mma(w_smem.index(0), x_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma),
                         use_acc=False, is_async=True)
    for g in range(1, G):
        s = g % STAGES
        scale = scale_next  # group g - 1's
        scale_next = gl.load(xs_ptr + rows * xs_stride + g, mask=row_ok, other=0.0) * gl.load(w_scales + g)
        mbarrier.wait(ready.index(s), (g // STAGES) & 1)
        cur = warpgroup_mma(w_smem.index(s), x_smem.index(s).permute((1, 0)),
                            gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma), use_acc=False, is_async=True)
        prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))  # group g - 1 done, group g in flight
        refill = g - 1 + STAGES
        if refill < G:  # group g - 1's slot is free: its wgmma has retired
            slot = refill % STAGES
            mbarrier.expect(ready.index(slot), stage_bytes)
            _tma_load(w_desc, [off_n, refill * _GROUP], ready.index(slot), w_smem.index(slot))
            _tma_load(x_desc, [0, refill * _GROUP], ready.index(slot), x_smem.index(slot))
        acc += prev * gl.expand_dims(scale, 0)
        prev = cur
    prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    acc += prev * gl.expand_dims(scale_next, 0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    # out[m, n] = acc[n, m]: each thread stores 8 consecutive columns (16 bytes) of a token row
    store: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])
    y = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store)
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, store))
    out_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, store))
    mask = gl.expand_dims(cols < N, 1) & gl.expand_dims(out_rows < M, 0)
    gl.store(out_ptr + gl.expand_dims(out_rows, 0) * out_stride + gl.expand_dims(cols, 1), y, mask=mask)


def warps(block_m: int) -> int:
    """One warpgroup, or two (each half the token rows) at 128 rows."""
    return 8 if block_m >= 128 else 4


def block_rows(m: int) -> int:
    """The token tile: M rounded up to a power of two (Gluon's ranges), at least 16."""
    return max(16, triton.next_power_of_2(m))


def descriptors(codes: torch.Tensor, weight: torch.Tensor, block_n: int, block_m: int
                ) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the weight codes ([N, K], BLOCK_N x GROUP tiles) and the activation codes ([M, K], all M
    rows x GROUP); rows past M read as zeros."""
    def desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
    return desc(weight, [block_n, GROUP]), desc(codes, [block_m, GROUP])


def compile_sm90(m: int, n: int, k: int, stages: int = 4):  # noqa: ANN201 - triton's CompiledKernel
    """The kernel as launched for `m` rows of an `[n, k]` weight, compiled for sm_90 without a GPU (tests check that
    it keeps one wgmma group in flight across the promotion, and the registers)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    block_m = block_rows(m)
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn)
    weight = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    w_desc, x_desc = descriptors(codes, weight, BLOCK_N, block_m)
    fn = _fp8_wgmma_kernel
    types = {"w_desc": mangle_type(w_desc), "x_desc": mangle_type(x_desc), "xs_ptr": "*fp32", "ws_ptr": "*fp32",
             "scale_row_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "G": "i32", "xs_stride": "i32",
             "ws_stride": "i32", "out_stride": "i32"}
    constexprs = {"BLOCK_N": BLOCK_N, "BLOCK_M": block_m, "STAGES": stages, "num_warps": warps(block_m)}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("xs_ptr", "ws_ptr", "out_ptr")}
    source = GluonASTSource(fn, types | {name: "constexpr" for name in constexprs}, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps(block_m)})


def fp8_wgmma_linear(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     scale_row: torch.Tensor, out_dtype: torch.dtype, *, stages: int = 4,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`codes [M, K]` (e4m3, from the activation quantization) with `x_scale [M, K / 128]` against `weight [N, K]`
    (e4m3) with `scale_inv [N / 128, K / 128]` -> `[M, N]` in `out_dtype`. M <= 128; every BLOCK_N rows of the
    weight in one scale block (`scale_row`, as fp8_gemm's)."""
    m, k = codes.shape
    n = weight.shape[0]
    groups = triton.cdiv(k, GROUP)
    if x_scale.shape != (m, groups) or x_scale.stride(1) != 1 or x_scale.dtype != torch.float32:
        raise ValueError(f"fp8_wgmma_linear: activation scales {tuple(x_scale.shape)} {x_scale.dtype} with strides "
                         f"{x_scale.stride()}, expected fp32 [{m}, {groups}] with a group stride of 1")
    if m > MAX_ROWS or k % GROUP or groups < stages or n % BLOCK_N:
        raise ValueError(f"fp8_wgmma_linear: M {m} (<= {MAX_ROWS}), K {k} (a multiple of {GROUP}, >= {stages} groups)"
                         f", N {n} (a multiple of {BLOCK_N})")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    block_m = block_rows(m)
    w_desc, x_desc = descriptors(codes, weight, BLOCK_N, block_m)
    _fp8_wgmma_kernel[(n // BLOCK_N,)](
        w_desc, x_desc, x_scale, scale_inv, scale_row, out, m, n, groups, x_scale.stride(0), scale_inv.stride(0),
        out.stride(0), BLOCK_N=BLOCK_N, BLOCK_M=block_m, STAGES=stages, num_warps=warps(block_m))
    return out
