"""Fingerprints of the sm_90 SASS of the kernels that share `split_k.last_arrival` (the split-K fix-up in the AWQ
and FP8 GEMMs, the decode attention's split merge, the GDN decode mixer) and of the (add +) RMSNorm kernel (its row
math shared with the FP8 norm + quantization kernel), compiled on a machine without a GPU: a refactor of shared
Triton helpers that must not change what runs shows the same fingerprints before and after.

    python3 packages/infer-backend-cuda/scripts/codegen_fingerprint.py        # run at both trees, compare

SASS, not PTX: an inlined helper moves debug labels and may move register arithmetic across a barrier in the PTX,
which ptxas schedules back to the same instructions. Addresses are stripped, so equal prints mean equal code.
"""

from __future__ import annotations

import hashlib
import importlib
import re

from infer_backend_cuda.kernels import attention_decode as AD, awq_gemv as AV, fp8_gemm as F8, gdn_decode as G
from sass_census import _cuobjdump, compile_sm90

RN = importlib.import_module("infer_backend_cuda.kernels.rms_norm")  # the package exports a function of that name
_ADDR = re.compile(r"/\*[0-9a-f]{4,}\*/")


def _types(fn, constexprs: dict, pointers: dict[str, str], floats: tuple[str, ...] = ()) -> dict[str, str]:  # noqa: ANN001
    """Each non-constexpr argument's type: `pointers` (else fp32 pointers) for `*_ptr`, fp32 for `floats`, else i32."""
    out = {}
    for p in fn.params:
        if p.name in constexprs:
            continue
        out[p.name] = pointers.get(p.name, "*fp32") if p.name.endswith("_ptr") else "fp32" if p.name in floats else "i32"
    return out


def _sass_print(fn, constexprs: dict, pointers: dict[str, str], floats: tuple[str, ...] = (), warps: int = 4,  # noqa: ANN001
                stages: int = 2) -> tuple[str, int]:
    kernel = compile_sm90(fn, _types(fn, constexprs, pointers, floats), constexprs, warps, stages)
    lines = [_ADDR.sub("", line).split(";")[0].strip() for line in _cuobjdump(kernel.asm["cubin"], "-sass").splitlines()
             if _ADDR.search(line)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], len(lines)


def cases():
    """(label, fingerprint, SASS lines) of each kernel in a served configuration with its last-arrival path on."""
    ce = dict(GROUP=128, HAS_BIAS=True, PARTIAL=True, FIXUP=True, BLOCK_M=1, BLOCK_N=128, BLOCK_K=8, UNROLL=16,
              ROW_PROGRAMS=False, PRELOAD=True, USE_PDL=True)
    yield "awq gemv, split-K fix-up", *_sass_print(AV._awq_gemv_kernel, ce, {
        "x_ptr": "*bf16", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "b_ptr": "*fp16", "out_ptr": "*bf16",
        "counter_ptr": "*i32"})
    ce = dict(GROUP=128, HAS_BIAS=False, DOT_F32=False, SKINNY=False, GROUPS_PER_SPLIT=8, PARTIAL=True, FIXUP=True,
              BLOCK_M=16, BLOCK_N=64, FUSE_QUANT=False, ROUND_IN_FP32=False, W_SCALE_UNIFORM=True, USE_PDL=True)
    yield "fp8 tiles, split-K fix-up", *_sass_print(F8._fp8_gemm_kernel, ce, {
        "xq_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "row_ptr": "*i32", "out_ptr": "*bf16", "counter_ptr": "*i32"},
        stages=3)
    ce = dict(GROUP=2, GP=2, NVB=4, K=4, KP=4, BK=128, BV=32, BD=128, USE_PDL=True)
    yield "gdn decode, group norm", *_sass_print(G._gdn_decode_kernel, ce, {
        "qkv_ptr": "*bf16", "z_ptr": "*bf16", "b_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
        "conv_ptr": "*bf16", "cu_ptr": "*i32", "slot_ptr": "*i32", "arrive_ptr": "*i32"}, ("scale", "eps"))
    ce = dict(GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, DOT_F32=False, RAGGED=False, DIRECT=False,
              ROPE=True, HALF=64, HAS_Q_NORM=True, HAS_K_NORM=True, MERGE=True, SPLITS_PAD=32, GROUP_PAD=4,
              GATED=False, HEADS_FASTEST=True, USE_PDL=True)
    yield "decode attention, merge", *_sass_print(AD._decode_split_kernel, ce, {
        "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "o_ptr": "*bf16", "seq_lens_ptr": "*i32",
        "bt_ptr": "*i32", "qsl_ptr": "*i32", "counter_ptr": "*i32", "k_ptr": "*bf16", "v_ptr": "*bf16",
        "pos_ptr": "*i64", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "slot_ptr": "*i64", "g_ptr": "*bf16"},
        ("scale", "eps"))
    ce = dict(HAS_RESIDUAL=True, BLOCK=4096, USE_PDL=True)  # Qwen3-4B's hidden 2560, 8 warps
    yield "add + rms norm", *_sass_print(RN._rms_norm_kernel, ce, {
        "x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16"},
        ("eps",), warps=8)


def main() -> None:
    for label, fingerprint, lines in cases():
        print(f"{label:<28} {fingerprint}  ({lines} SASS instructions)")


if __name__ == "__main__":
    main()
