"""The backend port: device, memory, graph capture and the op bundles."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, NamedTuple, Protocol, Sequence

from infer_core.dtypes import DType
from infer_core.ports.op_ports import OpPorts
from infer_core.ports.tensor import Tensor


class MemoryInfo(NamedTuple):
    free_bytes: int
    total_bytes: int


class GraphRunner(Protocol):
    """A captured computation over address-stable buffers; `replay` reruns it on their current contents."""

    def replay(self) -> None: ...


class HostTransfer(Protocol):
    """Device-to-host copies started without waiting: `ready()` polls, `wait()` blocks and gives the host tensors."""

    def ready(self) -> bool: ...

    def wait(self) -> list[Tensor]: ...


class LlmBackend(Protocol):
    """One compute backend. Constructed as `Backend(device=..., dtype=...)` from the entry point group
    `rustinfer.backends`."""

    name: str
    device: str  # torch device string, e.g. "cpu" or "cuda:0"
    ops: OpPorts
    supports_graphs: bool
    # The device's memory is the host's RAM, shared with everything else on the machine and with no allocator
    # peak to read: the KV cache gets a configured byte budget (`cpu_kv_cache_bytes`) instead of what a memory
    # profile of the worst-case step leaves (`memory_info`, `peak_memory_bytes`).
    host_memory: bool

    def torch_dtype(self, dtype: DType) -> object:
        """The framework dtype for a core DType."""
        ...

    def default_dtype(self) -> DType:
        """The activation/weight dtype: the one the backend was constructed with, else (`dtype=None`, the config's
        `auto`) the one it prefers."""
        ...

    def memory_info(self) -> MemoryInfo: ...

    def reset_peak_memory(self) -> None: ...

    def peak_memory_bytes(self) -> int: ...

    def synchronize(self) -> None: ...

    def staging_buffer(self, num_bytes: int) -> Tensor:
        """A uint8 host buffer the device copies from without the host waiting (page-locked on CUDA)."""
        ...

    def copy_to_host(self, tensors: Sequence[Tensor]) -> HostTransfer:
        """Start copying `tensors` to host memory behind the work queued so far (no host synchronisation)."""
        ...

    def trace_range(self, name: str) -> AbstractContextManager[None]:
        """A named range for profilers (NVTX on CUDA); free when no profiler listens."""
        ...

    def capture_graph(self, fn: Callable[[], None], warmup: int = 1) -> GraphRunner:
        """Capture `fn` (which reads and writes only persistent tensors); only when `supports_graphs`."""
        ...

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: DType
    ) -> list[tuple[Tensor, Tensor]]:
        """Per layer a (k_cache, v_cache) pair, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        ...

    def join_tensor_parallel(self, timeout_s: float) -> None:
        """Make `ops.collective` span the ranks of this process's torch.distributed default group (the worker
        initialised it): the adapter opens a data group of its own kind (gloo on the CPU, NCCL on CUDA), whose
        collectives fail after `timeout_s`. Called once, before a model is built on `ops`."""
        ...

    def eager_variant_batch_sizes(self, max_batch_seqs: int) -> list[int]:
        """The numbers of sequences, up to `max_batch_seqs`, at which an eager step first meets a kernel variant
        that smaller steps do not compile (kernels specialised on a bucket of the batch size). The worker runs one
        step of each at start-up, so that no compile of seconds stalls serving. Empty when nothing compiles."""
        ...

    def serving_started(self) -> None:
        """Start-up is done: from here a compile stalls the steps of running requests. A backend that compiles
        kernels on first use reports each later compile (the CUDA backend logs Triton's, with the kernel's name)."""
        ...

    def is_fatal_error(self, exc: BaseException) -> bool:
        """Whether `exc`, raised while a step was prepared or ran, leaves the device unusable (a device-side assert,
        an illegal address: every later call fails too), so the process must end; otherwise only that step failed."""
        ...
