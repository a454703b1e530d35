"""The paged prefill attention kernel alone at long-prompt shapes: one `--tokens`-long prompt prefilled in chunks
of each `--chunks` size (as the scheduler splits it: each chunk attends causally to itself and to the paged cache
of all earlier chunks), timed per launch (CUDA graph replays of ten launches, CUDA events), for the default kernel
(on Hopper at head_dim 128 the warp-specialised Gluon kernel `attention_prefill_ws.py`, unless
INFER_CUDA_WS_PREFILL=0), the Triton kernel's default tile (`triton`) and other Triton tiles.

    python bench/attention_prefill.py                       # Qwen3-4B shape, 16k tokens in 1, 2 and 8 chunks
    python bench/attention_prefill.py --head-dim 256 --heads 16 --kv-heads 4    # Qwen3.5's full-attention layers
    python bench/attention_prefill.py --configs default triton 64,64,4,2 --chunks 8192

Prints per (chunk size, config): the kernel time of one layer for the whole prompt, its TFLOP/s (4 * D * Hq per
visible query-key pair), the time x `--layers`, and the same for the prompt's last chunk alone (the one after
the longest prefix), and the largest difference of the output from the first config's (a config that computes
wrong values shows here); `sdpa` rows time torch's scaled_dot_product_attention on dense K/V for the same chunks, a
yardstick: torch's own backend choice, and with `--sdpa-backends cudnn flash` each of those forced (`sdpa:cudnn`;
on the H100 cuDNN ran a 16k prompt in one chunk at 607 TFLOP/s, flash at 344, and after a cached prefix both below
this kernel). `--device cpu` with tiny sizes is a dry run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from infer_backend_cuda import kernels as K
from infer_backend_cuda.kernels import attention_prefill

Config = tuple[int, int, int, int] | None  # (BLOCK_M, BLOCK_N, num_warps, num_stages); None: the kernel's choice
# Tried after the default when --configs is not given, per head_dim class (64,64,4,2 was the tile before the
# 128-row one; 128,128,8,2 and 128,32,8,2 are at the edge of the registers on sm_90).
CANDIDATES = {128: ["default", "triton", "64,64,4,2"], 256: ["default", "128,32,8,2", "64,32,8,3"]}


def parse_config(text: str, head_dim: int = 128) -> Config:
    """'default': the launcher's choice (the Gluon kernel where enabled and it serves); 'triton': the Triton
    kernel's default tile; else BLOCK_M,BLOCK_N,warps,stages of the Triton kernel."""
    if text == "default":
        return None
    if text == "triton":
        return attention_prefill._prefill_config(head_dim, 2)
    bm, bn, warps, stages = (int(x) for x in text.split(","))
    return bm, bn, warps, stages


def chunk_flops(q_len: int, ctx: int, heads: int, head_dim: int) -> float:
    """Multiply-adds x 2 of QK^T and PV over the visible pairs: q_len rows see the prefix plus a causal triangle."""
    return 4.0 * head_dim * heads * (q_len * (ctx - q_len) + q_len * (q_len + 1) / 2)


def time_call(fn: Callable[[], object], device: str, reps: int, per_sample: int = 10) -> float:
    """Median seconds of one call. On the GPU: replays of a CUDA graph of `per_sample` calls, timed with CUDA
    events, so that the host's launch time (tens of microseconds a Triton launch, as long as a 512-token chunk's
    kernel) is not counted, as in the served engine's graphs."""
    fn()
    fn()
    if device == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(per_sample):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        samples = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / per_sample)
        return statistics.median(samples)
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


class Prompt:
    """One sequence's K/V for `tokens` positions in consecutive pages of a paged cache (and densely, for sdpa),
    and the queries of every position."""

    def __init__(self, args: argparse.Namespace) -> None:
        gen = torch.Generator(device=args.device).manual_seed(0)
        dev, dt, bs = args.device, torch.bfloat16, args.block_size
        n_pages = math.ceil(args.tokens / bs)
        shape = (n_pages * bs, args.kv_heads, args.head_dim)
        self.k, self.v = (torch.randn(shape, generator=gen, device=dev, dtype=dt) for _ in range(2))
        self.k_cache = self.k.view(n_pages, bs, args.kv_heads, args.head_dim)
        self.v_cache = self.v.view(n_pages, bs, args.kv_heads, args.head_dim)
        self.q = torch.randn((args.tokens, args.heads, args.head_dim), generator=gen, device=dev, dtype=dt)
        self.block_table = torch.arange(n_pages, dtype=torch.int32, device=dev)[None]
        self.out = torch.empty_like(self.q)
        self.scale = args.head_dim**-0.5
        self.group = args.heads // args.kv_heads

    def kernel(self, start: int, q_len: int, config: Config) -> Callable[[], object]:
        dev = self.q.device
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
        seq_lens = torch.tensor([start + q_len], dtype=torch.int32, device=dev)
        q, out = self.q[start : start + q_len], self.out[start : start + q_len]
        return lambda: K.paged_attention_prefill(q, self.k_cache, self.v_cache, qsl, seq_lens, self.block_table,
                                                 q_len, self.scale, out=out, config=config)

    def sdpa(self, start: int, q_len: int, backend: str | None = None) -> Callable[[], object]:
        """torch's attention on this chunk's dense K/V; `backend` (an `SDPBackend` name, "cudnn" for
        CUDNN_ATTENTION, "math") forces one."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        ctx = start + q_len
        q = self.q[start:ctx].transpose(0, 1)[None]
        k, v = (x[:ctx].repeat_interleave(self.group, dim=1).transpose(0, 1)[None] for x in (self.k, self.v))
        mask = causal_lower_right(q_len, ctx)
        if backend is None:
            return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        forced = getattr(SDPBackend, backend.upper(), None) or getattr(SDPBackend, f"{backend.upper()}_ATTENTION")

        def call() -> torch.Tensor:
            with sdpa_kernel([forced]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

        return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunks", type=int, nargs="+", default=[16384, 8192, 2048])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--configs", nargs="+", help="'default' or BLOCK_M,BLOCK_N,warps,stages (default: candidates)")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--sdpa-backends", nargs="*", default=[], help="also time sdpa forced to each: cudnn, flash, "
                    "efficient, math")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.configs = args.configs or CANDIDATES[128 if args.head_dim <= 128 else 256]
    prompt = Prompt(args)
    default = attention_prefill._prefill_config(args.head_dim, 2)
    ws_kernel = attention_prefill.attention_prefill_ws
    gluon = ws_kernel.ENABLED and ws_kernel.supported(prompt.q, prompt.k_cache)
    print(f"prompt {args.tokens} tokens, Hq {args.heads} Hkv {args.kv_heads} D {args.head_dim}, pages of "
          f"{args.block_size}; 'default' runs the {'warp-specialised Gluon' if gluon else 'Triton'} kernel, 'triton' the Triton tile "
          f"{default}; x{args.layers} layers")
    print(f"{'chunks':>12} {'config':>14} {'ms/layer':>9} {'TFLOP/s':>8} {'ms x L':>8} | {'last ms':>8} {'TFLOP/s':>8}"
          f" {'max|diff|':>9}")
    variants: list[tuple[str, Callable[[int, int], Callable[[], object]]]] = [
        (text, lambda s, n, c=parse_config(text, args.head_dim): prompt.kernel(s, n, c)) for text in args.configs]
    if not args.no_sdpa and args.device == "cuda":
        variants.append(("sdpa", prompt.sdpa))
        variants += [(f"sdpa:{be}", lambda s, n, be=be: prompt.sdpa(s, n, be)) for be in args.sdpa_backends]
    for chunk in args.chunks:
        spans = [(s, min(chunk, args.tokens - s)) for s in range(0, args.tokens, chunk)]
        flops = [chunk_flops(n, s + n, args.heads, args.head_dim) for s, n in spans]
        first = None  # the first config's output: every other config must agree with it
        for name, make in variants:
            prompt.out.fill_(float("nan"))
            try:
                secs = [time_call(make(s, n), args.device, args.reps) for s, n in spans]
            except Exception as e:  # a config past the shared memory / registers of this GPU
                print(f"{len(spans):>4} x {chunk:<5} {name:>14} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            if name.startswith("sdpa"):  # its last chunk against the first config's
                s, n = spans[-1]
                got, want = make(s, n)()[0].transpose(0, 1), first[s : s + n] if first is not None else None
            else:
                first = prompt.out.clone() if first is None else first
                got, want = prompt.out, first
            diff = "" if want is None else f"{(got.float() - want.float()).abs().max().item():9.2e}"
            total = sum(secs)
            print(f"{len(spans):>4} x {chunk:<5} {name:>14} {total * 1e3:9.2f} {sum(flops) / total / 1e12:8.1f} "
                  f"{total * args.layers * 1e3:8.1f} | {secs[-1] * 1e3:8.2f} {flops[-1] / secs[-1] / 1e12:8.1f} {diff}")


if __name__ == "__main__":
    main()
