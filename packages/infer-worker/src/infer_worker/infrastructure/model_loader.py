"""Builds a model from an HF directory: config.json -> ModelSpec -> registered class -> weights on device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from infer_core.dtypes import DType
from infer_core.ports.backend import LlmBackend
from infer_worker.infrastructure.weight_loader import iter_safetensors
from infer_worker.models.causal_lm import CausalLM
from infer_worker.models.registry import check_servable, model_class
from infer_worker.models.spec import ModelSpec

LoadFormat = Literal["auto", "dummy"]
LOAD_FORMATS = ("auto", "dummy")


class LoadedModel(NamedTuple):
    model: CausalLM
    spec: ModelSpec


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json (expected a Hugging Face model directory)")
    return json.loads(path.read_text())


def read_spec(model_dir: Path) -> ModelSpec:
    """The checkpoint's ModelSpec from config.json, refusing what the engine cannot serve (no weight is read)."""
    config = read_config(model_dir)
    check_servable(config)
    return ModelSpec.from_hf_config(config)


def resolve_dtype(dtype: DType | str, backend: LlmBackend) -> DType:
    """`"auto"` is the backend's preferred dtype (fp32 on CPU, bf16 on CUDA), not the checkpoint's."""
    if isinstance(dtype, DType):
        return dtype
    return backend.default_dtype() if dtype == "auto" else DType.parse(dtype)


def load_model(
    model_dir: Path, backend: LlmBackend, dtype: DType | str = "auto", load_format: LoadFormat | str = "auto", seed: int = 0
) -> LoadedModel:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    spec = read_spec(model_dir)
    resolved = resolve_dtype(dtype, backend)
    if not resolved.is_float:
        raise ValueError(f"model dtype must be a float type, got {resolved.value}")
    torch_dtype = backend.torch_dtype(resolved)
    if not isinstance(torch_dtype, torch.dtype):
        raise TypeError(f"backend {backend.name!r} maps {resolved.value} to {torch_dtype!r}, not a torch dtype")
    model = model_class(spec.architecture)(spec, backend.ops, torch_dtype, backend.device)
    if load_format == "dummy":
        model.init_dummy_weights(seed)
    else:
        slices = {name: slot.shard for name, slot in model.weight_slots().items() if slot.shard is not None}
        model.load_weights(iter_safetensors(Path(model_dir), slices))
    return LoadedModel(model, spec)
