"""The CPU backend: pure-PyTorch reference ops bundled behind the LlmBackend port."""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Sequence

import torch

from infer_core.dtypes import DType
from infer_core.ports.backend import GraphRunner, MemoryInfo
from infer_core.ports.op_ports import OpPorts
from infer_backend_cpu.collective import GlooCollective, SingleProcessCollective
from infer_backend_cpu.fused_ops import CpuFusedOps
from infer_backend_cpu.gated_delta import CpuGatedDeltaOps
from infer_backend_cpu.host_memory import host_memory_info
from infer_backend_cpu.linear_ops import CpuLinears
from infer_backend_cpu.math_ops import CpuMathOps
from infer_backend_cpu.sampler import CpuSampler

_TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.INT32: torch.int32,
    DType.INT64: torch.int64,
}


class HostTensors:
    """A finished "transfer": the tensors already live on the host."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors

    def ready(self) -> bool:
        return True

    def wait(self) -> list[torch.Tensor]:
        return self._tensors


class CpuBackend:
    name: str = "cpu"
    supports_graphs: bool = False
    host_memory: bool = True

    def __init__(self, device: str = "cpu", dtype: DType | str | None = None) -> None:
        device = device or "cpu"
        if torch.device(device).type != "cpu":
            raise ValueError(f"the cpu backend runs on device 'cpu', not {device!r}")
        self.device: str = device
        # fp32 by default: CPU matmuls in bf16 are slow and the reference backend should be exact.
        if dtype == "auto":  # the config's word for "the backend's choice", as on CUDA
            dtype = None
        self._default_dtype = DType.parse(dtype) if isinstance(dtype, str) else (dtype or DType.FLOAT32)
        fused = CpuFusedOps()
        self.ops = OpPorts(
            math=CpuMathOps(), fused=fused, sampler=CpuSampler(), collective=SingleProcessCollective(),
            linears=CpuLinears(fused), gdn=CpuGatedDeltaOps(device),
        )

    @staticmethod
    def available() -> bool:
        return True

    def torch_dtype(self, dtype: DType) -> torch.dtype:
        return _TORCH_DTYPES[dtype]

    def default_dtype(self) -> DType:
        return self._default_dtype

    def memory_info(self) -> MemoryInfo:
        return host_memory_info()

    def reset_peak_memory(self) -> None:
        # The host has no resettable allocator peak; KV sizing on CPU uses a configured byte budget instead.
        return None

    def peak_memory_bytes(self) -> int:
        return 0

    def staging_buffer(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8)

    def copy_to_host(self, tensors: Sequence[torch.Tensor]) -> HostTensors:
        # CPU work is done when the call returns: nothing to wait for. Copies, like a device-to-host transfer, so
        # that a later step reusing the same buffers (the graph runner's outputs) cannot change them.
        return HostTensors([t.clone() for t in tensors])

    def trace_range(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()

    def synchronize(self) -> None:
        return None  # CPU ops are synchronous

    def join_tensor_parallel(self, timeout_s: float) -> None:
        self.ops = dataclasses.replace(self.ops, collective=GlooCollective(timeout_s))

    def eager_variant_batch_sizes(self, max_batch_seqs: int) -> list[int]:
        return []  # torch ops on the CPU: nothing compiles per batch size

    def serving_started(self) -> None:
        pass  # torch ops on the CPU: nothing compiles on first use

    def is_fatal_error(self, exc: BaseException) -> bool:
        return False  # host memory only: an exception never leaves state behind that later steps would trip on

    def capture_graph(self, fn: Callable[[], None], warmup: int = 1) -> GraphRunner:
        raise NotImplementedError("the cpu backend cannot capture graphs (supports_graphs is False); run eagerly")

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: DType
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        torch_dtype = self.torch_dtype(dtype)
        # Zeroed, not empty: a stray read of an unwritten slot is then deterministic and finite.
        return [
            (torch.zeros(shape, dtype=torch_dtype, device=self.device), torch.zeros(shape, dtype=torch_dtype, device=self.device))
            for _ in range(num_layers)
        ]
