"""The decode attention's split rule at served shapes (Qwen3-4B: 32 query heads, 8 KV heads, head_dim 128, BF16
pages of 16): GPU time per call (CUDA-graph replays, `graph_timing.py`) against the KV byte floor, for the split
count of `choose_num_splits` at several wave targets. `--registers`: afterwards, the registers and spill of every
variant the run compiled (what ptxas gave the loaded kernel, the figure that sets how many programs an SM holds).
`--configs BLOCK_N:WARPS:STAGES,...`: the default split count under each key tile config instead of the wave targets.
`--rope`: the served form instead of the plain kernel: q, k and v from a raw qkv projection row with the q / k norms,
RoPE and the new token's store in the split pass (`DecodeRope`), as the model launches it.
`--cases BATCHxCONTEXT,...`: CONTEXT is one length or LO-HI, spread from HI (row 0) down to LO (a served batch in
admission order). `--variants LAYOUT:ORDER,...`: the default split count and tile under each cache layout (`nhd`, the
served pages `[page, Hkv, D]`, or `hnd`, `[Hkv, page, D]` passed to the kernel as a strided view) and grid order
(`seq`, the sequences fastest, or `heads`, `INFER_CUDA_DECODE_HEADS_FASTEST`'s KV heads fastest).

    PYTHONPATH=packages/infer-core/src:packages/infer-backend-cuda/src \\
        python3 packages/infer-backend-cuda/scripts/bench_decode_splits.py --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from graph_timing import copy_bandwidth, graph_replay_us
from infer_backend_cuda.kernels import attention_decode as A
from infer_backend_cuda.kernels._common import resident_programs

HQ, HKV, D, BS = 32, 8, 128, 16
CASES = ((1, 300), (12, 3000), (32, 1000), (64, 384), (96, 350), (128, 384), (256, 640), (32, 16384))


def paged(batch: int, ctx: int, layout: str = "nhd") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K / V caches `[blocks, BS, HKV, D]` (with "hnd" a view of `[blocks, HKV, BS, D]` storage) and a block table
    of randomly placed pages."""
    pages = (ctx + BS - 1) // BS
    nb = batch * pages + 1
    shape = (nb, HKV, BS, D) if layout == "hnd" else (nb, BS, HKV, D)
    kc = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    if layout == "hnd":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    bt = torch.randperm(nb - 1, device="cuda")[: batch * pages].view(batch, pages).to(torch.int32)
    return kc, vc, bt


def context_lengths(batch: int, spec: str) -> torch.Tensor:
    """`[batch]` int32 contexts: "N" for all, or "LO-HI" spread evenly from HI (row 0) down to LO, as a served
    batch in admission order holds them (the oldest request has generated the most)."""
    lo, _, hi = spec.partition("-")
    if not hi:
        return torch.full((batch,), int(lo), dtype=torch.int32, device="cuda")
    return torch.linspace(int(hi), int(lo), batch, device="cuda").round().to(torch.int32)


def served_rope(batch: int, ctx: int, bt: torch.Tensor, device: str = "cuda",
                lens: torch.Tensor | None = None) -> tuple[torch.Tensor, A.DecodeRope]:
    """The served form's inputs: q / k / v as views of one `[batch, (HQ + 2 HKV) D]` projection row, the q / k
    norm weights, a full-width rotary table, and the new token (position `lens - 1`, ctx - 1 when not given) stored
    at its cache slot."""
    qkv = torch.randn((batch, (HQ + 2 * HKV) * D), device=device, dtype=torch.bfloat16)
    q = qkv[:, : HQ * D].view(batch, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(batch, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(batch, HKV, D)
    positions = (lens if lens is not None else torch.full((batch,), ctx, device=device)).to(torch.int64) - 1
    cos_sin = torch.randn((ctx, D), device=device, dtype=torch.float32)
    norm = torch.ones(D, device=device, dtype=torch.bfloat16)
    page = bt.gather(1, (positions // BS)[:, None])[:, 0].to(torch.int64)
    slots = page * BS + positions % BS
    return q, A.DecodeRope(k, v, positions, cos_sin, norm, norm, 1e-6, slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waves", default="2,4,8")
    ap.add_argument("--json")
    ap.add_argument("--registers", action="store_true", help="print each compiled variant's registers and spill")
    ap.add_argument("--configs", help="BLOCK_N:WARPS:STAGES,... tile configs to time (default: the kernel's own)")
    ap.add_argument("--rope", action="store_true", help="time the served form (fused q/k norm, RoPE and store)")
    ap.add_argument("--cases", help="BATCHxCONTEXT,... (default: the served shapes above)")
    ap.add_argument("--variants", help="LAYOUT:ORDER,... (nhd / hnd : seq / heads) to time at the default config")
    args = ap.parse_args()
    waves = [int(w) for w in args.waves.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    cases = [(int(b), c) for b, c in (x.split("x") for x in args.cases.split(","))] if args.cases else [
        (b, str(c)) for b, c in CASES]
    for batch, ctx_spec in cases:
        lens = context_lengths(batch, ctx_spec)
        ctx = int(lens.max())  # pages for the longest; each row reads its own length
        kc, vc, bt = paged(batch, ctx)
        q, rope = served_rope(batch, ctx, bt, lens=lens) if args.rope else (
            torch.randn((batch, HQ, D), device="cuda", dtype=torch.bfloat16), None)
        floor_us = 2 * int(lens.sum()) * HKV * D * 2 / copy_bandwidth() * 1e6  # K and V read once, at the copy rate
        row = {"batch": batch, "ctx": ctx_spec, "floor_us": floor_us}
        for w in waves if not (args.configs or args.variants) else ():
            splits = max(1, min(A.MAX_SPLITS, triton.cdiv(w * sms, batch * HKV)))
            row[f"w{w}_s{splits}"] = graph_replay_us(lambda _, s=splits: A.paged_attention_decode(
                q, kc, vc, lens, bt, D**-0.5, num_splits=s, rope=rope), calls=5)
        default_order = A.HEADS_FASTEST
        for variant in args.variants.split(",") if args.variants else ():
            layout, order = variant.split(":")
            kcv, vcv, btv = (kc, vc, bt) if layout == "nhd" else paged(batch, ctx, layout)
            qv, ropev = served_rope(batch, ctx, btv, lens=lens) if args.rope else (q, None)
            A.HEADS_FASTEST = order == "heads"  # what INFER_CUDA_DECODE_HEADS_FASTEST sets, here per variant
            row[f"v{variant}"] = graph_replay_us(lambda _: A.paged_attention_decode(
                qv, kcv, vcv, lens, btv, D**-0.5, rope=ropev), calls=5)
            del kcv, vcv
        A.HEADS_FASTEST = default_order
        for config in args.configs.split(",") if args.configs else ():
            bn, warps, stages = map(int, config.split(":"))
            A.TILE = (bn, warps, stages)  # what INFER_CUDA_DECODE_TILE sets, here per config
            row[f"c{bn}:{warps}:{stages}"] = graph_replay_us(lambda _: A.paged_attention_decode(
                q, kc, vc, lens, bt, D**-0.5, rope=rope), calls=5)
        rows.append(row)
        cells = " ".join(f"{k}={v:.1f}" for k, v in row.items() if k not in ("batch", "ctx", "floor_us"))
        print(f"B={batch:>3} ctx={ctx_spec:>7} floor={floor_us:7.1f} us | {cells}", flush=True)
        del kc, vc
    if args.registers:
        print(registers_report())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def registers_report() -> str:
    """One line per compiled variant of the split pass (in compile order): registers a thread, spill bytes, shared
    memory, and the programs an SM holds at once (`resident_programs`: registers, shared memory, threads)."""
    lines = []
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    for kernel_cache, *_ in A._decode_split_kernel.device_caches.values():
        for compiled in kernel_cache.values():
            compiled._init_handles()
            warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
            resident = resident_programs(compiled.n_regs, warps, shared, props.regs_per_multiprocessor,
                                         props.shared_memory_per_multiprocessor, props.max_threads_per_multi_processor)
            lines.append(f"split pass: {compiled.n_regs} registers, {compiled.n_spills} spill, {warps} warps, "
                         f"{compiled.metadata.num_stages} stages, {shared} B shared -> {resident} programs "
                         f"({resident * warps} warps) an SM")
    return "\n".join(lines) or "no compiled variant"


if __name__ == "__main__":
    main()
