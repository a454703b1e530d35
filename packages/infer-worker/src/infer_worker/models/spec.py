"""ModelSpec: the architecture facts of an HF `config.json`, parsed and checked once.

Accepts both config generations: transformers 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters`, `dtype`), and multimodal configs whose text settings sit under `text_config` (Qwen3.5).
Anything the model code cannot honour (another activation, sliding windows, an unknown layer type or rope
scaling) is refused here with a clear message instead of producing silently wrong text later.

What varies between architectures is spelled out as data here (`qk_norm`, `attention_output_gate`,
`norm_offset`, `layer_types`, `rotary_dim`, `linear_attention`, `mrope_section`, `vision`), so the model code never
asks which model it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from infer_core.dtypes import DType
from infer_core.quant import DENSE_CONFIG, QuantConfig
from infer_worker.components.gated_delta_net import LinearAttentionSpec
from infer_worker.components.rotary import SUPPORTED_ROPE_TYPES, RopeScaling
from infer_worker.components.vision import VisionConfig
from infer_worker.models.quantization import quant_config_from_hf

# Architectures whose attention normalises q and k per head (their checkpoints carry q_norm/k_norm weights).
_QWEN3_5 = frozenset({"Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"})
_QK_NORM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM"}) | _QWEN3_5
# Qwen3.5's full attention: q_proj holds [query | gate] per head and the output is `attn * sigmoid(gate)`.
_OUTPUT_GATE_ARCHITECTURES = _QWEN3_5
# Qwen3.5's decoder norms (and q/k norms) scale by (1 + w): checkpoints store w - 1 of an ordinary RMSNorm.
_NORM_OFFSET = {arch: 1.0 for arch in _QWEN3_5}
# For configs without `architectures` (e.g. built by hand): the HF class of each model_type.
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
}
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
_LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
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
    layer_types: tuple[str, ...] = ()  # each layer's token mixer (FULL_ATTENTION / LINEAR_ATTENTION); () = all full
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates (partial rotary); 0 = head_dim
    attention_output_gate: bool = False  # q_proj is [query | gate] per head; attention output * sigmoid(gate)
    norm_offset: float = 0.0  # added to every decoder / q-k norm weight at load: (1 + w) norms store w
    linear_attention: LinearAttentionSpec | None = None  # the Gated DeltaNet layers' geometry, when there are any
    # Multimodal RoPE: the rotary frequencies' split over (temporal, height, width) positions, interleaved; () = 1-D
    # RoPE only. Text tokens have three equal positions, which is ordinary RoPE.
    mrope_section: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # the vision tower (config.json's `vision_config`), when the model has one

    @property
    def mixers(self) -> tuple[str, ...]:
        """Each layer's token mixer."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    @property
    def num_attention_layers(self) -> int:
        """Layers with a paged KV cache."""
        return self.mixers.count(FULL_ATTENTION)

    @property
    def num_state_layers(self) -> int:
        """Layers with a per-sequence state slot instead (linear attention)."""
        return self.mixers.count(LINEAR_ATTENTION)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelSpec":
        architecture = architecture_of(config)
        vision = config.get("vision_config")
        config = _text_settings(config)
        missing = [key for key in _REQUIRED_KEYS if key not in config]
        if missing:  # e.g. a config trimmed by hand
            raise ValueError(f"config.json of {architecture} lacks {', '.join(missing)}")
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        _check_supported(config)
        rope_theta, rope_scaling = _rope(config)
        head_dim = int(config.get("head_dim") or hidden_size // num_heads)
        num_layers = int(config["num_hidden_layers"])
        layer_types = _layer_types(config, num_layers)
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
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
            layer_types=layer_types,
            rotary_dim=_rotary_dim(config, head_dim),
            attention_output_gate=architecture in _OUTPUT_GATE_ARCHITECTURES,
            norm_offset=_NORM_OFFSET.get(architecture, 0.0),
            linear_attention=_linear_attention(config) if LINEAR_ATTENTION in layer_types else None,
            mrope_section=_mrope_section(config, _rotary_dim(config, head_dim)),
            vision=VisionConfig.from_hf(vision) if isinstance(vision, Mapping) else None,
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


def _text_settings(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal config's text model settings (`text_config`) with the top-level keys they lack (e.g.
    `quantization_config`); a text-only config as it is. The head's tying is the whole model's: the top level
    wins there (transformers ties `lm_head` by the outer config; the text config may carry its own default)."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return config
    merged = {**{k: v for k, v in config.items() if k != "text_config"}, **text}
    if "tie_word_embeddings" in config:
        merged["tie_word_embeddings"] = config["tie_word_embeddings"]
    return merged


def _layer_types(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    types = tuple(config.get("layer_types") or (FULL_ATTENTION,) * num_layers)
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: {', '.join(_LAYER_TYPES)}")
    return types


def _rotary_dim(config: Mapping[str, Any], head_dim: int) -> int:
    parameters = config.get("rope_parameters") or {}
    partial = float(config.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} of {head_dim} dims; an even number "
                         f"of dims from 2 to head_dim must rotate")
    return rotary_dim


def _mrope_section(config: Mapping[str, Any], rotary_dim: int) -> tuple[int, ...]:
    parameters: Mapping[str, Any] = config.get("rope_scaling") or config.get("rope_parameters") or {}
    section = tuple(int(n) for n in parameters.get("mrope_section") or ())
    if section and (len(section) != 3 or sum(section) != rotary_dim // 2):
        raise ValueError(f"mrope_section {list(section)} must split the {rotary_dim // 2} rotary frequencies in three")
    return section


def _linear_attention(config: Mapping[str, Any]) -> LinearAttentionSpec:
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    missing = [key for key in keys if key not in config]
    if missing:
        raise ValueError(f"linear_attention layers need {', '.join(missing)} in config.json")
    spec = LinearAttentionSpec(*(int(config[key]) for key in keys))
    if spec.num_v_heads % spec.num_k_heads:
        raise ValueError(f"{spec.num_v_heads} linear value heads cannot share {spec.num_k_heads} key heads")
    return spec


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
