"""The ports: what the worker's model code needs from a compute backend (typing.Protocols).

Tensors are typed by the `Tensor` alias so that core never imports torch. Model code is bound to one
backend's op bundles at construction time; there are no per-op registry look-ups on the hot path.
"""

from infer_core.ports.backend import GraphRunner, LlmBackend, MemoryInfo
from infer_core.ports.collective import Collective
from infer_core.ports.fused_ops import AttentionBatch, FusedOps
from infer_core.ports.linear_attention import GatedDeltaOps, GdnLayer, StateBatch, unfused_gated_delta_mix
from infer_core.ports.linear_ops import LinearOps, LinearOpsFactory
from infer_core.ports.math_ops import MathOps
from infer_core.ports.op_ports import OpPorts
from infer_core.ports.sampler import SampleOutput, Sampler, SamplingBatch
from infer_core.ports.tensor import Tensor

__all__ = [
    "AttentionBatch",
    "Collective",
    "FusedOps",
    "GatedDeltaOps",
    "GdnLayer",
    "GraphRunner",
    "LlmBackend",
    "LinearOps",
    "LinearOpsFactory",
    "MathOps",
    "MemoryInfo",
    "OpPorts",
    "SampleOutput",
    "Sampler",
    "StateBatch",
    "SamplingBatch",
    "Tensor",
    "unfused_gated_delta_mix",
]
