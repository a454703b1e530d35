"""The aggregate a model is built against: every op bundle of one backend."""

from __future__ import annotations

from dataclasses import dataclass

from infer_core.ports.collective import Collective
from infer_core.ports.fused_ops import FusedOps
from infer_core.ports.linear_attention import GatedDeltaOps
from infer_core.ports.linear_ops import LinearOpsFactory
from infer_core.ports.math_ops import MathOps
from infer_core.ports.sampler import Sampler


@dataclass(frozen=True, slots=True)
class OpPorts:
    math: MathOps
    fused: FusedOps
    sampler: Sampler
    collective: Collective
    linears: LinearOpsFactory  # per weight scheme (dense, AWQ, block FP8) the GEMM-bearing ops
    # The linear-attention ops of hybrid models (Qwen3.5); None on a backend without them, where such a model is
    # refused when it is built (models of attention layers alone never read it).
    gdn: GatedDeltaOps | None = None
