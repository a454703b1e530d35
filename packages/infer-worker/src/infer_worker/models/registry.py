"""HF `architectures[0]` -> the model class that implements it."""

from __future__ import annotations

from typing import Any, Mapping

from infer_worker.models.causal_lm import CausalLMClass
from infer_worker.models.llama import LlamaForCausalLM
from infer_worker.models.qwen3 import Qwen3ForCausalLM
from infer_worker.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from infer_worker.models.spec import architecture_of

MODEL_CLASSES: dict[str, CausalLMClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
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


def check_servable(config: Mapping[str, Any]) -> None:
    """Refuse, from config.json alone and before any weight is read, a checkpoint this engine cannot serve: an
    architecture without a model class (else the first missing key or unexpected weight name would be the only
    message). A quantization_config the engine cannot serve is refused by `quant_config_from_hf`, which
    `ModelSpec.from_hf_config` calls, naming the field."""
    architecture = architecture_of(config)
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"model architecture {architecture} (model_type {config.get('model_type', '?')}) is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
