"""`quantization_config` of an HF config.json -> `QuantConfig`, with every layout the kernels cannot serve refused
at start-up in one line that names the field.

Served: AutoAWQ "gemm" int4 with zero points (Qwen/Qwen3-4B-AWQ) and block FP8 e4m3 with dynamic activations
(Qwen/Qwen3-4B-FP8, DeepSeek-V3). Group and block boundaries against each linear's size are checked when the model
allocates its linears (`QuantScheme.check`), where the module is known by name.
"""

from __future__ import annotations

from typing import Any, Mapping

from infer_core.quant import DENSE_CONFIG, QuantConfig, QuantScheme

_FIELD = "quantization_config"
_SUPPORTED = "'awq' (AutoAWQ gemm, 4 bits) and 'fp8' (block FP8 e4m3, dynamic activations)"


def quant_config_from_hf(config: Mapping[str, Any]) -> QuantConfig:
    qc = config.get(_FIELD)
    if not qc:
        return DENSE_CONFIG
    if not isinstance(qc, Mapping):
        raise ValueError(f"{_FIELD} must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(qc)
    if method == "fp8":
        return _fp8(qc)
    raise ValueError(f"unsupported {_FIELD}.quant_method {qc.get('quant_method')!r}; supported: {_SUPPORTED}")


def _not_converted(qc: Mapping[str, Any]) -> tuple[str, ...]:
    # transformers' AWQ/FP8 configs say modules_to_not_convert; vLLM-style FP8 configs say ignored_layers.
    names = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{_FIELD}.modules_to_not_convert must be a list of module names, got {names!r}")
    return tuple(names)


def _awq(qc: Mapping[str, Any]) -> QuantConfig:
    bits = qc.get("bits", qc.get("w_bit"))  # w_bit / q_group_size: AutoAWQ's own quant_config.json spelling
    if bits != 4:
        raise ValueError(f"{_FIELD}.bits is {bits!r}; AWQ is served with 4 bits only")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise ValueError(f"{_FIELD}.group_size is {group!r}; a positive group of input rows is needed "
                         f"(per-channel -1 is not supported)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{_FIELD}.version is {qc.get('version')!r}; only AutoAWQ's 'gemm' layout is supported")
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"{_FIELD}.zero_point is {qc.get('zero_point')!r}; only zero-point AWQ (qzeros) is supported")
    if qc.get("desc_act") or qc.get("act_order"):
        raise ValueError(f"{_FIELD}.desc_act: act-order (permuted groups) is not supported")
    return QuantConfig(QuantScheme.awq(group), _not_converted(qc))


def _fp8(qc: Mapping[str, Any]) -> QuantConfig:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"{_FIELD}.fmt is {qc.get('fmt')!r}; only e4m3 FP8 is supported")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ValueError(f"{_FIELD}.activation_scheme is {qc.get('activation_scheme')!r}; only 'dynamic' (per-token, "
                         f"per-block activation scales computed at run time) is supported, not static input scales")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError(f"{_FIELD}.weight_block_size is missing: per-tensor FP8 is not supported, only block FP8")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{_FIELD}.weight_block_size is {block!r}; expected [block_out, block_in]")
    block_out, block_in = block
    if block_in & (block_in - 1) or not 16 <= block_in <= 256:
        # The activation group is one K step of the kernels: a power-of-two tile.
        raise ValueError(f"{_FIELD}.weight_block_size[1] is {block_in}; a power of two from 16 to 256 is supported")
    return QuantConfig(QuantScheme.fp8_block(block_out, block_in), _not_converted(qc))
