"""ModelSpec: the architecture facts of an HF `config.json`, parsed and checked once.

Accepts both config generations: transformers 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters`, `dtype`). Anything the model code cannot honour (another activation, sliding windows,
partial rotary, an unknown rope scaling) is refused here with a clear message instead of producing
silently wrong text later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from infer_core.dtypes import DType
from infer_core.quant import DENSE_CONFIG, QuantConfig
from infer_worker.components.rotary import SUPPORTED_ROPE_TYPES, RopeScaling
from infer_worker.models.quantization import quant_config_from_hf

# Architectures whose attention normalises q and k per head (their checkpoints carry q_norm/k_norm weights).
_QK_NORM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM"})
# For configs without `architectures` (e.g. built by hand): the HF class of each model_type.
_ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DEFAULT_ROPE_THETA = 10000.0
_REQUIRED_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: DType | None = None  # the checkpoint's declared dtype (a core DType, despite the HF name)
    quantization: QuantConfig = DENSE_CONFIG  # the layout of the linear weights (dense, AWQ, block FP8)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelSpec":
        architecture = architecture_of(config)
        missing = [key for key in _REQUIRED_KEYS if key not in config]
        if missing:  # e.g. a multimodal config with its text settings under `text_config`
            raise ValueError(f"config.json of {architecture} lacks {', '.join(missing)}")
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        _check_supported(config)
        rope_theta, rope_scaling = _rope(config)
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=architecture in _QK_NORM_ARCHITECTURES,
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            eos_token_ids=_token_ids(config.get("eos_token_id")),
            bos_token_id=config.get("bos_token_id"),
            torch_dtype=_dtype(config.get("dtype") or config.get("torch_dtype")),
            quantization=quant_config_from_hf(config),
        )


def architecture_of(config: Mapping[str, Any]) -> str:
    """The HF class name a config declares (`architectures[0]`, else the class of its `model_type`)."""
    architectures = config.get("architectures") or []
    if architectures:
        return str(architectures[0])
    model_type = config.get("model_type", "")
    if model_type in _ARCHITECTURE_OF_MODEL_TYPE:
        return _ARCHITECTURE_OF_MODEL_TYPE[model_type]
    raise ValueError(f"config.json names no architecture (architectures={architectures}, model_type={model_type!r})")


def _check_supported(config: Mapping[str, Any]) -> None:
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"unsupported hidden_act {activation!r}; only 'silu' (gated SiLU MLP) is implemented")
    if config.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported (use_sliding_window is true)")
    partial = config.get("partial_rotary_factor", (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported (partial_rotary_factor={partial})")


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_theta`/`rope_scaling` (4.x) or `rope_parameters` (5.x)."""
    parameters: Mapping[str, Any] = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = float(config.get("rope_theta") or parameters.get("rope_theta") or _DEFAULT_ROPE_THETA)
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(parameters["factor"]),
        low_freq_factor=float(parameters["low_freq_factor"]),
        high_freq_factor=float(parameters["high_freq_factor"]),
        original_max_position_embeddings=int(parameters["original_max_position_embeddings"]),
    )


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype(name: str | None) -> DType | None:
    if not name:
        return None
    try:
        return DType.parse(str(name))
    except ValueError:
        return None  # an exotic checkpoint dtype only matters for "auto", which then falls back to the backend's
