"""What tensor parallelism needs of a Llama-family checkpoint, checked from config.json before any rank starts:
every split dimension divides by the degree, block FP8 splits on whole blocks, and AWQ (whose packed int4
columns the ranks cannot split) and hybrid models (whose Gated DeltaNet layers are not sharded) are refused. Each refusal is one line naming the field."""

from __future__ import annotations

from infer_core.quant import QuantMethod
from infer_worker.models.spec import ModelSpec

_BLOCK_FIELD = "quantization_config.weight_block_size"


def check_tensor_parallel(spec: ModelSpec, world: int) -> None:
    if world == 1:
        return
    if spec.linear_attention is not None:
        raise ValueError(f"config.json layer_types has linear_attention layers (a hybrid model): not supported with "
                         f"tensor_parallel_size {world}; use tensor_parallel_size 1")
    fields = {
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
    }
    for field, value in fields.items():
        if value % world:
            raise ValueError(f"config.json {field} = {value} does not divide by tensor_parallel_size {world}")
    scheme = spec.quantization.scheme
    if scheme.method is QuantMethod.AWQ:
        raise ValueError(f"quantization_config.quant_method 'awq' is not supported with tensor_parallel_size {world} "
                         f"(its packed int4 columns are not split); use tensor_parallel_size 1")
    if scheme.method is QuantMethod.FP8_BLOCK:
        block_out, block_in = scheme.block
        # Each rank's slice of a column-parallel output (q, k, v heads; gate/up channels) and of a row-parallel
        # input (o_proj's heads, down's channels) must be whole scale blocks.
        splits = {
            "num_attention_heads * head_dim": (spec.num_heads * spec.head_dim, (block_out, block_in)),
            "num_key_value_heads * head_dim": (spec.num_kv_heads * spec.head_dim, (block_out,)),
            "intermediate_size": (spec.intermediate_size, (block_out, block_in)),
        }
        for field, (size, blocks) in splits.items():
            for block in blocks:
                if (size // world) % block:
                    raise ValueError(f"config.json {field} = {size} over tensor_parallel_size {world} gives "
                                     f"{size // world}, not a multiple of the FP8 block {block} ({_BLOCK_FIELD})")


def local_kv_heads(spec: ModelSpec, world: int) -> int:
    """The KV heads one rank attends with, and caches."""
    return spec.num_kv_heads // world
