"""CUDA backend: Triton and Numba CUDA kernels, CUDA graphs.

`import infer_backend_cuda` needs only torch and infer_core (triton / numba load when a backend is built),
so the entry point `infer_backend_cuda:CudaBackend` resolves on any machine; constructing `CudaBackend`
without a GPU raises RuntimeError.
"""

from infer_backend_cuda.backend import CudaBackend, CudaGraph

__all__ = ["CudaBackend", "CudaGraph"]
