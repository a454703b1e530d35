"""Triton kernels of the CUDA adapter, one module per kernel family, each with a small Python launcher.

Every launcher takes torch tensors (CUDA tensors on a GPU; CPU tensors under ``TRITON_INTERPRET=1``),
computes in fp32 inside the kernel, accepts bf16 / fp16 / fp32 inputs, and takes an optional ``out=``
so tests can hand in poisoned buffers. Importing this package imports triton.
"""

from infer_backend_cuda.kernels.activation import sigmoid_gate_mul, silu_and_mul
from infer_backend_cuda.kernels.attention_decode import paged_attention_decode
from infer_backend_cuda.kernels.attention_prefill import paged_attention_prefill
from infer_backend_cuda.kernels.qk_norm_rope import qk_norm_rope_store
from infer_backend_cuda.kernels.rms_norm import add_rms_norm, rms_norm
from infer_backend_cuda.kernels.sampling import merge_partials, topk_topp_threshold

__all__ = [
    "add_rms_norm",
    "merge_partials",
    "paged_attention_decode",
    "paged_attention_prefill",
    "qk_norm_rope_store",
    "rms_norm",
    "sigmoid_gate_mul",
    "silu_and_mul",
    "topk_topp_threshold",
]
