"""HF `architectures[0]` -> the model class that implements it."""

from __future__ import annotations

from infer_worker.models.causal_lm import CausalLMClass
from infer_worker.models.llama import LlamaForCausalLM
from infer_worker.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, CausalLMClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def model_class(architecture: str) -> CausalLMClass:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
