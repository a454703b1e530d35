"""Numba CUDA kernels of the adapter: the sampler's seeded draw, arg-max and log-sum-exp, in one pass.

`sample_partials` reads each row of logits once, split over `C` chunks (grid `(N, C)`, so a single row still
spreads over many SMs), and per chunk produces
- the draw's best candidate (value, index): for greedy rows (temperature 0) the largest raw logit; for
  sampled rows the largest `e_v / -log(u_v)` over the kept tokens, where `e_v = exp((x_v - x_max) / T)` is
  the token's probability up to the row's normalising constant (which does not change the arg-max) and a
  token is kept when `x_v >= threshold` (top-k / top-p cut, from `sampler.py`) and `e_v >= min_p`
  (min-p: `p_v >= min_p * p_max` is `e_v >= min_p`);
- an online (max, sum-exp) of the raw logits, for the chosen token's log-probability.
`merge_partials` (a one-program-per-row Triton kernel over the `[N, C]` partials) takes the first maximal chunk (lowest index on ties, as
torch.argmax) and combines the log-sum-exp.

Why Numba for this step (and torch for the sort that finds the thresholds): the draw is irregular integer
work, not tensor algebra. Each kept element needs an exact 32-bit integer hash of (seed, position, vocab
index) in 64-bit integer arithmetic and a float64 `-log(u)`; filtered-out tokens cost no hash and no log;
the (value, index) arg-max with a deterministic tie-break and the (max, sum) pairs reduce through shared
memory; and nothing of size `[N, V]` (u, -log u, p / E, probabilities) is materialised, as the same logic
in torch would. A segmented sort is what torch already does well, so the thresholds stay there.

Kernels launch on torch's current stream (`numba.cuda.external_stream`) with torch tensors wrapped by
`numba.cuda.as_cuda_array` (no copy, no stream sync), so they are captured in CUDA graphs; `warmup()`
compiles them (explicit signature) and launches once before any capture. Under `NUMBA_ENABLE_CUDASIM=1`
(CI without a GPU) the same launcher hands the CPU tensors' numpy views to the simulator.

The counter-based draw (shared with the CPU backend), int64 arithmetic, M = 0xFFFFFFFF:

    mix32(x) = ((x >> 16) ^ x) * 0x45D9F3B & M, twice, then (x >> 16) ^ x
    h = mix32((seed & M) ^ mix32(position & M))              # per row
    u = (float(mix32((h + vocab_index) & M)) + 0.5) / 2**32   # float64 in (0, 1)
    token = argmax_v probs[v] / -log(u_v)                     # over the kept tokens
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import threading

import torch

from infer_backend_cuda.numba_compat import apply_numpy_compat

M32 = 0xFFFFFFFF

# Threads per block: the GPU uses 256; the simulator (one Python thread per CUDA thread) 16 to stay fast.
GPU_THREADS = 256
SIM_THREADS = 16
MAX_CHUNKS = 64

_lock = threading.Lock()
_kernels: dict[str, object] = {}
_streams: dict[tuple[int, int], object] = {}
_configured = False

# The kernels name `cuda` as a module global (bound on first build, so importing this module does not
# import numba): Numba's simulator swaps module globals that are `numba.cuda` for its fake module.
cuda = None


def _cuda():
    global _configured
    apply_numpy_compat()
    from numba import cuda as numba_cuda

    if not _configured:
        # One block per (row, chunk) is a deliberately small grid at low batch; Numba's "grid size < 128"
        # NumbaPerformanceWarning would fire (with a new message text per batch size) on every launch.
        for name in ("numba.cuda.core.config", "numba.core.config"):
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(mod, "CUDA_LOW_OCCUPANCY_WARNINGS"):
                mod.CUDA_LOW_OCCUPANCY_WARNINGS = 0
        _configured = True
    return numba_cuda


def simulator_enabled() -> bool:
    apply_numpy_compat()
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def threads_per_block() -> int:
    return SIM_THREADS if simulator_enabled() else GPU_THREADS


_SIGNATURE = (
    "void(float32[:, ::1], float32[::1], float32[::1], float32[::1], float32[::1], int64[::1], int64[::1], "
    "int64, float64[:, ::1], int64[:, ::1], float32[:, ::1], float32[:, ::1])"
)


def _build_sample_partials(tpb: int):
    global cuda
    cuda = _cuda()
    from numba import float32, float64, int64

    @cuda.jit(device=True)
    def mix32(x):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        return (x >> 16) ^ x

    @cuda.jit(_SIGNATURE)
    def sample_partials_kernel(
        logits, temperature, threshold, row_max, min_p, seeds, positions, all_greedy, part_val, part_idx, part_m, part_s
    ):
        row = cuda.blockIdx.x
        chunk = cuda.blockIdx.y
        n_chunks = cuda.gridDim.y
        tid = cuda.threadIdx.x
        vocab = logits.shape[1]
        per_chunk = (vocab + n_chunks - 1) // n_chunks
        lo = chunk * per_chunk
        hi = min(vocab, lo + per_chunk)

        s_val = cuda.shared.array(tpb, dtype=float64)
        s_idx = cuda.shared.array(tpb, dtype=int64)
        s_m = cuda.shared.array(tpb, dtype=float32)
        s_s = cuda.shared.array(tpb, dtype=float32)

        best = -math.inf
        best_i = vocab
        m = float32(-math.inf)
        s = float32(0.0)
        temp = temperature[row]
        greedy = all_greedy != 0 or temp == 0.0
        if greedy:
            v = lo + tid
            # 4 loads in flight per thread (memory-level parallelism), then the scalar updates in order
            while v + 3 * tpb < hi:
                x0 = logits[row, v]
                x1 = logits[row, v + tpb]
                x2 = logits[row, v + 2 * tpb]
                x3 = logits[row, v + 3 * tpb]
                for j in range(4):
                    x = x0 if j == 0 else (x1 if j == 1 else (x2 if j == 2 else x3))
                    if x > best:
                        best = float64(x)
                        best_i = v + j * tpb
                    if x > m:
                        s = s * math.exp(m - x) + float32(1.0)
                        m = x
                    elif x > -math.inf:
                        s += math.exp(x - m)
                v += 4 * tpb
            while v < hi:
                x = logits[row, v]
                if x > best:
                    best = float64(x)
                    best_i = v
                if x > m:
                    s = s * math.exp(m - x) + float32(1.0)
                    m = x
                elif x > -math.inf:
                    s += math.exp(x - m)
                v += tpb
        else:
            thr = threshold[row]
            xmax = row_max[row]
            mp = min_p[row]
            h = mix32((seeds[row] & 0xFFFFFFFF) ^ mix32(positions[row] & 0xFFFFFFFF))
            v = lo + tid
            while v < hi:
                x0 = logits[row, v]
                x1 = logits[row, v + tpb] if v + tpb < hi else float32(-math.inf)
                x2 = logits[row, v + 2 * tpb] if v + 2 * tpb < hi else float32(-math.inf)
                x3 = logits[row, v + 3 * tpb] if v + 3 * tpb < hi else float32(-math.inf)
                for j in range(4):
                    x = x0 if j == 0 else (x1 if j == 1 else (x2 if j == 2 else x3))
                    vj = v + j * tpb
                    if x > m:
                        s = s * math.exp(m - x) + float32(1.0)
                        m = x
                    elif x > -math.inf:
                        s += math.exp(x - m)
                    if x >= thr and vj < hi:
                        e = math.exp((x - xmax) / temp)
                        if e >= mp and e > 0.0:
                            u = (float64(mix32((h + vj) & 0xFFFFFFFF)) + 0.5) / 4294967296.0
                            q = float64(e) / -math.log(u)
                            if q > best:
                                best = q
                                best_i = vj
                v += 4 * tpb
        s_val[tid] = best
        s_idx[tid] = best_i
        s_m[tid] = m
        s_s[tid] = s
        cuda.syncthreads()
        stride = tpb // 2
        while stride > 0:
            if tid < stride:
                ov = s_val[tid + stride]
                oi = s_idx[tid + stride]
                if ov > s_val[tid] or (ov == s_val[tid] and oi < s_idx[tid]):
                    s_val[tid] = ov
                    s_idx[tid] = oi
                m1 = s_m[tid]
                m2 = s_m[tid + stride]
                if m2 > m1:
                    s_s[tid] = s_s[tid + stride] + (s_s[tid] * math.exp(m1 - m2) if m1 > -math.inf else float32(0.0))
                    s_m[tid] = m2
                elif m2 > -math.inf:
                    s_s[tid] = s_s[tid] + s_s[tid + stride] * math.exp(m2 - m1)
            cuda.syncthreads()
            stride //= 2
        if tid == 0:
            part_val[row, chunk] = s_val[0]
            part_idx[row, chunk] = s_idx[0]
            part_m[row, chunk] = s_m[0]
            part_s[row, chunk] = s_s[0]

    return sample_partials_kernel


def get_sample_partials_kernel():
    """The compiled kernel (built, and on a GPU compiled for its one signature, on first use)."""
    k = _kernels.get("sample_partials")
    if k is None:
        with _lock:
            k = _kernels.get("sample_partials")
            if k is None:
                k = _build_sample_partials(threads_per_block())
                _kernels["sample_partials"] = k
    return k


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_chunks(n_rows: int, vocab: int, device: torch.device) -> int:
    """Chunks per row: enough blocks for ~8 per SM (full occupancy at 256 threads), each chunk at least 4 x threads-per-block tokens. Depends
    only on (rows, vocab), which a captured graph fixes."""
    tpb = threads_per_block()
    if device.type == "cuda":
        target = 8 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 2 * max(1, n_rows)  # simulator: exercise the chunk merge with few blocks
    chunks = max(1, -(-target // max(1, n_rows)))
    return max(1, min(MAX_CHUNKS, chunks, vocab // (4 * tpb) or 1))


def _torch_stream(device: torch.device):
    c = _cuda()
    ptr = torch.cuda.current_stream(device).cuda_stream
    key = (device.index or 0, ptr)
    s = _streams.get(key)
    if s is None:
        s = c.external_stream(ptr)
        _streams[key] = s
    return s


def _device_ctx(device: torch.device):
    idx = device.index or 0
    if idx == 0:
        return contextlib.nullcontext()
    return _cuda().gpus[idx]


def sample_partials(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    threshold: torch.Tensor,
    row_max: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    all_greedy: bool,
    chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel; returns per-(row, chunk) `(best value f64, best index i64, max f32, sum-exp f32)`.

    logits `[N, V]` float32; temperature / threshold / row_max / min_p `[N]` float32; seeds / positions `[N]`
    int64. CUDA tensors launch on torch's current stream; CPU tensors run in the Numba simulator."""
    n_rows, vocab = logits.shape
    dev = logits.device
    c = int(chunks or choose_chunks(n_rows, vocab, dev))
    part_val = torch.empty((n_rows, c), dtype=torch.float64, device=dev)
    part_idx = torch.empty((n_rows, c), dtype=torch.int64, device=dev)
    part_m = torch.empty((n_rows, c), dtype=torch.float32, device=dev)
    part_s = torch.empty((n_rows, c), dtype=torch.float32, device=dev)
    if n_rows == 0:
        return part_val, part_idx, part_m, part_s
    f32 = lambda t: t.to(device=dev, dtype=torch.float32).contiguous()  # noqa: E731
    i64 = lambda t: t.to(device=dev, dtype=torch.int64).contiguous()  # noqa: E731
    arrays = (f32(logits), f32(temperature), f32(threshold), f32(row_max), f32(min_p), i64(seeds), i64(positions))
    outs = (part_val, part_idx, part_m, part_s)
    kernel = get_sample_partials_kernel()
    tpb = threads_per_block()
    flag = 1 if all_greedy else 0
    if logits.is_cuda:
        nc = _cuda()
        with _device_ctx(dev):
            stream = _torch_stream(dev)
            a = [nc.as_cuda_array(t, sync=False) for t in arrays]
            o = [nc.as_cuda_array(t, sync=False) for t in outs]
            kernel[(n_rows, c), tpb, stream](*a, flag, *o)
    else:
        if not simulator_enabled():
            raise RuntimeError(
                "numba CUDA kernels need CUDA tensors, or the simulator (NUMBA_ENABLE_CUDASIM=1) for CPU tensors"
            )
        kernel[(n_rows, c), tpb](*[t.detach().numpy() for t in arrays], flag, *[t.numpy() for t in outs])
    return outs


def merge_partials(
    logits: torch.Tensor, part_val: torch.Tensor, part_idx: torch.Tensor, part_m: torch.Tensor, part_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids int64 `[N]`, logprobs float32 `[N]`) from the per-chunk partials: the first maximal chunk
    (lowest token index on ties, as torch.argmax) and the combined log-sum-exp (one Triton launch)."""
    from infer_backend_cuda.kernels.sampling import merge_partials as _merge

    return _merge(logits, part_val, part_idx, part_m, part_s)


def warmup(device: torch.device | str | None = None) -> None:
    """Compile the Numba kernels and launch each once (module load into the context) before any graph
    capture. On a GPU this runs on torch's current stream and synchronises once."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() and not simulator_enabled() else torch.device("cpu")
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn((2, 64), generator=gen).to(device)
    z = lambda *v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    i = lambda *v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    parts = sample_partials(logits, z(0.0, 1.0), logits.min(dim=1).values, logits.max(dim=1).values, z(0.0, 0.0), i(1, 2), i(0, 1), False)
    merge_partials(logits, *parts)
    if device.type == "cuda":
        _warm_merge_variants(device)
        torch.cuda.synchronize(device)


WARM_VOCAB = 151_936  # a vocabulary wide enough that the chunk count is set by the row count alone
WARM_ROWS = 4096


def merge_variant(chunks: int) -> tuple[int, bool, bool]:
    """What the merge kernel compiles a variant for, given the chunk count: its padded width (`CPAD`) and Triton's
    specialisation of the integer argument (equal to 1, divisible by 16)."""
    return max(2, 1 << (chunks - 1).bit_length()), chunks == 1, chunks % 16 == 0


def merge_warm_chunks(device: torch.device, rows: int = WARM_ROWS, vocab: int = WARM_VOCAB) -> list[int]:
    """One chunk count for each merge-kernel variant that batches of 1..rows rows meet on this device."""
    first: dict[tuple[int, bool, bool], int] = {}
    for n in range(1, rows + 1):
        chunks = choose_chunks(n, vocab, device)
        first.setdefault(merge_variant(chunks), chunks)
    return sorted(first.values())


def _warm_merge_variants(device: torch.device) -> None:
    """Compile every merge-kernel variant serving can meet, before it does: a batch whose row count gives a chunk
    count of a new variant (e.g. 33 rows: 32 chunks on 132 SMs) otherwise compiled one in the middle of serving, and
    every running request waited ~0.1 s (the compile watch's log on a fresh H100, nineteenth session). Both classes
    of the vocabulary (and logits row stride) Triton specialises on: divisible by 16 or not."""
    for chunks in merge_warm_chunks(device):
        for vocab in (WARM_VOCAB, WARM_VOCAB + 1):
            logits = torch.zeros((1, vocab), dtype=torch.float32, device=device)
            parts = (torch.zeros((1, chunks), dtype=torch.float64, device=device),
                     torch.zeros((1, chunks), dtype=torch.int64, device=device),
                     torch.zeros((1, chunks), dtype=torch.float32, device=device),
                     torch.ones((1, chunks), dtype=torch.float32, device=device))
            merge_partials(logits, *parts)
