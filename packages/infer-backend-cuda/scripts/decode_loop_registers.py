"""Registers of the decode attention's key loop, construct by construct, compiled for sm_90 without a GPU.

A stand-alone copy of `attention_decode._decode_split_kernel`'s key loop (16 query rows of one KV head, `BLOCK_N`
paged keys a step, fp32 online softmax) with each of the kernel's constructs behind a switch: the masked key /
value loads (`n < end`), the page ids loaded a tile ahead, run-time cache strides, the empty-row guard, and a loop
start the compiler cannot see is a multiple of `BLOCK_N`. The register count sets how many programs an SM holds
(65,536 registers: 128 a thread at 4 warps is four programs, 16 warps of 64), which bounds the loads in flight.
Compiled with the divisibility hints a launch gives (16-byte aligned pointers and strides): without them loads are
not vectorised and the counts (254-255 in the fifteenth session) say nothing about the launched kernel.

    python3 packages/infer-backend-cuda/scripts/decode_loop_registers.py
"""

from __future__ import annotations

import triton
import triton.language as tl

from sass_census import _cuobjdump, compile_sm90


@triton.jit
def _key_loop(q_ptr, k_ptr, v_ptr, bt_ptr, o_ptr, start, end, s0, s1, s2, kvh, scale,
              PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              ALIGNED: tl.constexpr, MASKS: tl.constexpr, AHEAD: tl.constexpr, STRIDES: tl.constexpr,
              GUARD: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + offs_h[:, None] * BLOCK_D + offs_d[None, :])
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    lo = start // BLOCK_N * BLOCK_N if ALIGNED else start
    if AHEAD:
        first = lo + tl.arange(0, BLOCK_N)
        page = tl.load(bt_ptr + first // PAGE, mask=first < end, other=0).to(tl.int64)
    for n0 in range(lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if not AHEAD:
            page = tl.load(bt_ptr + offs_n // PAGE).to(tl.int64)
        in_page = (offs_n % PAGE).to(tl.int64)
        if STRIDES:
            row = page * s0 + in_page * s1 + kvh.to(tl.int64) * s2
        else:
            row = page * (PAGE * 8 * BLOCK_D) + in_page * (8 * BLOCK_D) + kvh.to(tl.int64) * BLOCK_D
        # each load forms its own [BLOCK_N, BLOCK_D] addresses, as the kernel's do (one shared address tile would
        # stay live from the key load to the value load: ~100 registers more)
        if MASKS:
            k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + row[:, None] + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        if MASKS:
            s = tl.where(n_mask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if GUARD else m_new
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKS:
            v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + row[:, None] + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m_i = m_new
        if AHEAD:
            next_n = offs_n + BLOCK_N
            page = tl.load(bt_ptr + next_n // PAGE, mask=next_n < end, other=0).to(tl.int64)
    tl.store(o_ptr + offs_h[:, None] * BLOCK_D + offs_d[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


_SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "o_ptr": "*bf16", "start": "i32",
              "end": "i32", "s0": "i32", "s1": "i32", "s2": "i32", "kvh": "i32", "scale": "fp32"}
_DIVISIBLE = ("q_ptr", "k_ptr", "v_ptr", "bt_ptr", "o_ptr", "s0", "s1", "s2")  # as a launch at the real shapes
VARIANTS = {  # name: (ALIGNED, MASKS, AHEAD, STRIDES, GUARD)
    "bare": (True, False, False, False, False),
    "+ unaligned start": (False, False, False, False, False),
    "+ masked loads": (True, True, False, False, False),
    "+ page ids a tile ahead": (True, False, True, False, False),
    "+ run-time strides": (True, False, False, True, False),
    "all but the look-ahead": (True, True, False, True, True),
    "all (as the kernel)": (False, True, True, True, True),
}


def main() -> None:
    for name, (aligned, masks, ahead, strides, guard) in VARIANTS.items():
        ce = dict(PAGE=16, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, ALIGNED=aligned, MASKS=masks, AHEAD=ahead,
                  STRIDES=strides, GUARD=guard)
        kernel = compile_sm90(_key_loop, _SIGNATURE, ce, 4, 2, _DIVISIBLE)
        usage = next(line for line in _cuobjdump(kernel.asm["cubin"], "--dump-resource-usage").splitlines()
                     if "REG" in line)
        regs = int(usage.split("REG:")[1].split()[0])
        stack = int(usage.split("STACK:")[1].split()[0])
        print(f"{name:<26} {regs:>4} registers, {stack:>4} bytes of stack -> {65536 // (regs * 128) * 4} warps an SM")


if __name__ == "__main__":
    main()
