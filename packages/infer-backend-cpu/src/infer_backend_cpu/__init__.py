"""Pure-PyTorch reference backend (entry point `rustinfer.backends: cpu = infer_backend_cpu:CpuBackend`)."""

from infer_backend_cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
