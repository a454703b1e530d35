"""`CudaBackend`: the LlmBackend port on one NVIDIA GPU.

Importing this module needs only torch and infer_core; triton and numba are imported when a backend is
constructed (so `import infer_backend_cuda` works on any machine, and fails nowhere).
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import AbstractContextManager
from typing import Callable, Sequence

import torch

from infer_core.dtypes import DType
from infer_core.ports.backend import MemoryInfo
from infer_core.ports.op_ports import OpPorts

SKINNY_GEMM_ENV = "INFER_CUDA_SKINNY_GEMM"  # not under RUSTINFER_, the config loader's prefix
# What a sticky CUDA error's message contains when torch raises it as a RuntimeError.
_FATAL_MARKS = ("CUDA error", "cudaErrorIllegalAddress", "device-side assert")

_TORCH_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.INT32: torch.int32,
    DType.INT64: torch.int64,
}


def _normalise_device(device: str | None) -> torch.device:
    d = torch.device(device or "cuda:0")
    if d.type != "cuda":
        raise ValueError(f"CudaBackend needs a cuda device, got {device!r}")
    return torch.device("cuda", 0 if d.index is None else d.index)


class CudaGraph:
    """A captured CUDA graph; `replay()` reruns it on the current contents of its persistent buffers."""

    def __init__(self, graph: "torch.cuda.CUDAGraph") -> None:
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class PinnedTransfer:
    """Device-to-host copies into pinned buffers on the current stream, with an event marking their end."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, dev in zip(self._host, tensors):
            host.copy_(dev, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        return self._event.query()

    def wait(self) -> list[torch.Tensor]:
        self._event.synchronize()  # releases the GIL while it waits
        return self._host


class CudaBackend:
    """Triton fused ops + Numba sampler + cuBLAS GEMMs + CUDA graphs on one GPU.

    `CudaBackend(device="cuda:0")`; `device=""` or None means cuda:0. Raises RuntimeError without CUDA.
    """

    name = "cuda"
    supports_graphs = True
    host_memory = False

    @staticmethod
    def available() -> bool:
        """Whether this machine can run the backend (used by `backend = "auto"`)."""
        return torch.cuda.is_available()

    def __init__(self, device: str | None = "cuda:0", dtype: DType | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"CudaBackend needs an NVIDIA GPU, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). Use backend = \"cpu\"."
            )
        dev = _normalise_device(device)
        if dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"CudaBackend: {dev} does not exist ({torch.cuda.device_count()} GPU(s) visible)")
        torch.cuda.set_device(dev)
        self._device = dev
        self.device = str(dev)
        self._dtype = DType.parse(dtype) if isinstance(dtype, str) and dtype != "auto" else (
            dtype if isinstance(dtype, DType) else None
        )

        from infer_backend_cuda.gated_delta import CudaGatedDeltaOps
        from infer_backend_cuda.kernels import split_k
        from infer_backend_cuda.linear_ops import CudaLinears
        from infer_backend_cuda.ops import CudaMathOps, SingleDeviceCollective, TritonFusedOps
        from infer_backend_cuda.sampler import CudaSampler

        sampler = CudaSampler(dev)
        sampler.warmup()  # Numba kernels compiled and loaded before any graph capture
        # The split-K fix-up's arrival counters (the AWQ GEMMs' sum and the decode attention's merge; none with
        # INFER_CUDA_SPLIT_K_FIXUP=0), zeroed before any graph capture.
        split_k.allocate_counters(dev)
        # INFER_CUDA_SKINNY_GEMM=0 keeps every GEMM on cuBLAS (for A/B benchmarks and debugging).
        math = CudaMathOps(skinny_gemm=os.environ.get(SKINNY_GEMM_ENV, "1") != "0")
        fused = TritonFusedOps(math)
        self.ops = OpPorts(
            math=math, fused=fused, sampler=sampler, collective=SingleDeviceCollective(),
            linears=CudaLinears(math, fused), gdn=CudaGatedDeltaOps(self.device),
        )
        self._graph_pool = None

    # -- dtypes -------------------------------------------------------------------------------------------
    def torch_dtype(self, dtype: DType) -> torch.dtype:
        return _TORCH_DTYPES[DType(dtype)]

    def default_dtype(self) -> DType:
        return self._dtype or DType.BFLOAT16

    # -- memory -------------------------------------------------------------------------------------------
    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self._device)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def peak_memory_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self._device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def staging_buffer(self, num_bytes: int) -> torch.Tensor:
        # A copy from pageable memory would wait for the work queued before it; from page-locked memory it does not.
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)

    def copy_to_host(self, tensors: Sequence[torch.Tensor]) -> PinnedTransfer:
        return PinnedTransfer(tensors)

    def trace_range(self, name: str) -> AbstractContextManager[None]:
        return torch.cuda.nvtx.range(name)

    # -- errors -------------------------------------------------------------------------------------------
    def join_tensor_parallel(self, timeout_s: float) -> None:
        from infer_backend_cuda.collective import NcclCollective

        self.ops = dataclasses.replace(self.ops, collective=NcclCollective(self._device, timeout_s))

    def eager_variant_batch_sizes(self, max_batch_seqs: int) -> list[int]:
        from infer_backend_cuda.kernels._ragged import ragged_variant_batch_sizes  # triton loads with a backend

        return ragged_variant_batch_sizes(max_batch_seqs)

    def serving_started(self) -> None:
        from infer_backend_cuda import compile_watch  # triton loads with a backend

        compile_watch.watch()

    def is_fatal_error(self, exc: BaseException) -> bool:
        """A CUDA error (a device-side assert, an illegal address, a launch failure) is sticky: the context is
        unusable and every later call fails with it. torch raises it as `torch.AcceleratorError` (2.9+), a
        RuntimeError; older versions as a plain RuntimeError naming it."""
        accelerator_error = getattr(torch, "AcceleratorError", None)
        if accelerator_error is not None and isinstance(exc, accelerator_error):
            return True
        text = str(exc)
        return isinstance(exc, RuntimeError) and any(mark in text for mark in _FATAL_MARKS)

    # -- graphs -------------------------------------------------------------------------------------------
    def capture_graph(self, fn: Callable[[], None], warmup: int = 1) -> CudaGraph:
        """Warm `fn` up `warmup` times on a side stream (Triton JIT, cuBLAS workspace and allocator state
        settle outside the capture, as the torch docs recommend), then capture one call.

        All graphs of this backend share one memory pool (as vLLM does for its capture sizes): `fn` must
        read and write only persistent tensors, so its intermediates are dead after each replay and the
        graphs, replayed one at a time on one stream, never need each other's pool memory.
        """
        cur = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _ in range(max(0, int(warmup))):
                fn()
        cur.wait_stream(side)
        torch.cuda.synchronize(self._device)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            fn()
        torch.cuda.synchronize(self._device)
        return CudaGraph(graph)

    # -- KV cache -----------------------------------------------------------------------------------------
    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: DType
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One zeroed allocation `[layers, 2, blocks, block_size, Hkv, D]`; per layer contiguous (k, v) views.
        Zeroed so that never-written slots are finite (kernels mask them anyway)."""
        kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=self.torch_dtype(dtype),
            device=self._device,
        )
        return [(kv[i, 0], kv[i, 1]) for i in range(num_layers)]
