"""The CUDA adapter's op ports on CPU tensors, for machines without a GPU (CI): its Triton kernels run under
TRITON_INTERPRET (the suite-wide conftest sets it there), its GEMMs through torch, and sampling on the CPU
reference (the Numba sampler has its own tests). A model served through this backend exercises the adapter's
glue (which kernel a port calls, with which strides and metadata) that the per-kernel tests do not."""

from __future__ import annotations

from typing import Any

from infer_core.dtypes import DType
from infer_core.ports.op_ports import OpPorts
from infer_worker.infrastructure.backend_registry import create_backend


class InterpretedCudaBackend:
    name = "cuda-interpreted"
    supports_graphs = False
    host_memory = True
    device = "cpu"

    def __init__(self, dtype: DType = DType.FLOAT32) -> None:
        from infer_backend_cuda.gated_delta import CudaGatedDeltaOps
        from infer_backend_cuda.linear_ops import CudaLinears
        from infer_backend_cuda.ops import CudaMathOps, SingleDeviceCollective, TritonFusedOps

        self.cpu = create_backend("cpu", "cpu", dtype)
        math = CudaMathOps(skinny_gemm=True)
        fused = TritonFusedOps(math)
        self.ops = OpPorts(math=math, fused=fused, sampler=self.cpu.ops.sampler, collective=SingleDeviceCollective(),
                           linears=CudaLinears(math, fused), gdn=CudaGatedDeltaOps(self.device))

    def __getattr__(self, name: str) -> Any:  # memory, dtypes, KV allocation: the CPU backend's
        return getattr(self.cpu, name)
