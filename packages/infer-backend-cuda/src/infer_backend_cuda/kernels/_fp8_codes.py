"""Dynamic e4m3 activation quantization inside a kernel, the CPU reference's numerics (`infer_backend_cpu.quant_math`:
scale = amax / 448 per row and group, 1 where amax is 0; codes = e4m3(clamp(x / scale, ±448))), shared by the
quantization passes (fp8_gemm.py) and the GEMMs that quantize their own activation tiles (fp8_gemm.py, mid_gemm.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)  # kernels may read only constexpr globals


@triton.jit
def round_to_e4m3_grid(v):
    """`v` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32. Triton 3.9's interpreter casts
    fp32 to fp8 wrongly where rounding carries into the exponent (124.7 -> 64), so under it the cast is handed
    values it need not round; on the GPU the hardware conversion (cvt.rn.satfinite) rounds the same way."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    quantum = tl.exp2((tl.maximum(exponent, -6) - 3).to(tl.float32))  # 3 mantissa bits; subnormals below 2^-6
    t = v / quantum  # exact: a power of two
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r % 2 != 0), r - 1.0, r)
    return r * quantum


@triton.jit
def quantize_groups(x, ROUND_IN_FP32: tl.constexpr, AXIS: tl.constexpr):
    """fp32 `x` (zeros where masked), one group along AXIS (1: `[R, group]`; 0: `[group, R]`, a transposed tile) ->
    (fp32 codes on the e4m3 grid, fp32 scales `[R]`), the reference's numerics: IEEE divisions, so that the codes
    equal the CPU's bit for bit."""
    amax = tl.max(tl.abs(x), axis=AXIS)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32)), 1.0)
    if AXIS == 1:
        divisor = tl.zeros_like(x) + scale[:, None]
    else:
        divisor = tl.zeros_like(x) + scale[None, :]
    codes = tl.clamp(tl.math.div_rn(x, divisor), -E4M3_MAX, E4M3_MAX)
    if ROUND_IN_FP32:
        codes = round_to_e4m3_grid(codes)
    return codes, scale
