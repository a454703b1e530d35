"""CUDA backend: Triton and Numba CUDA kernels, CUDA graphs."""
