"""Self-attention over the paged KV cache: fused qkv GEMM -> (qk-norm) + RoPE + KV store + paged attention (one
port op, `FusedOps.qk_norm_rope_attention`, with the output gate) -> o_proj. Qk-norm is present exactly when its weights
are (Qwen3); nothing here knows model names.

With `output_gate` (Qwen3.5) q_proj holds `[query | gate]` per head (`2 * head_dim` rows each) and the attention
output is multiplied by `sigmoid(gate)` before o_proj. Partial rotary is the RoPE table's width (see
`FusedOps.qk_norm_rope_store`). A step whose batch carries its own rotary rows (`AttentionBatch.rope_cos_sin`,
multimodal RoPE) rotates token `i` by row `i` of those instead of the table's row at its position."""

from __future__ import annotations

import torch

from infer_core.ports.fused_ops import AttentionBatch
from infer_core.ports.linear_attention import StateBatch
from infer_core.ports.op_ports import OpPorts
from infer_core.quant import DENSE_CONFIG, ModuleQuant
from infer_worker.components.linear import Linear, MergedLinear
from infer_worker.components.sharding import Parallel, split
from infer_worker.components.weights import WeightInit, WeightSlot, WeightSlots, empty, prefixed

KvCache = tuple[torch.Tensor, torch.Tensor]


class Attention:
    def __init__(
        self,
        ops: OpPorts,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos_sin_cache: torch.Tensor,
        qk_norm: bool,
        bias: bool,
        norm_eps: float,
        dtype: torch.dtype,
        device: str,
        quant: ModuleQuant = ModuleQuant(DENSE_CONFIG),
        output_gate: bool = False,
        norm_offset: float = 0.0,
    ) -> None:
        """`quant` is the checkpoint's quantization seen from this module (`model.layers.N.self_attn.`)."""
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} kv heads")
        self._fused = ops.fused
        world = ops.collective.world_size  # each rank attends with its own heads (and their KV) alone
        self.num_heads = split(num_heads, world, "num_attention_heads")
        self.num_kv_heads = split(num_kv_heads, world, "num_key_value_heads")
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.cos_sin_cache = cos_sin_cache
        self.norm_eps = norm_eps
        self.output_gate = output_gate
        self.norm_offset = norm_offset
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qkv = (("q_proj", 2 * q_size if output_gate else q_size), ("k_proj", kv_size), ("v_proj", kv_size))
        self.qkv_proj = MergedLinear(
            ops, hidden_size, qkv, bias, dtype, device, quant.fused_scheme(tuple(n for n, _ in qkv)), quant.name(""),
            Parallel.COLUMN,
        )
        self.o_proj = Linear.allocate(
            ops, q_size, hidden_size, bias, dtype, device, quant.scheme("o_proj"), quant.name("o_proj"), Parallel.ROW
        )
        self.q_norm_weight = empty((head_dim,), dtype, device) if qk_norm else None
        self.k_norm_weight = empty((head_dim,), dtype, device) if qk_norm else None

    checkpoint_name = "self_attn"

    @property
    def in_proj(self) -> Linear:
        return self.qkv_proj

    def __call__(self, hidden: torch.Tensor, batch: AttentionBatch, kv_cache: KvCache) -> torch.Tensor:
        return self.attend(self.qkv_proj(hidden), batch, kv_cache)

    def mix(self, projected: torch.Tensor, batch: AttentionBatch, cache: KvCache,
            states: StateBatch | None) -> torch.Tensor:
        """The token mixer of a decoder layer (`components/mixer.py`): no per-sequence state of its own."""
        return self.attend(projected, batch, cache)

    def attend(self, qkv: torch.Tensor, batch: AttentionBatch, kv_cache: KvCache) -> torch.Tensor:
        """Everything after the qkv GEMM (which the decoder layer fuses with the norm before it)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.part_sizes, dim=-1)
        gate = None
        if self.output_gate:
            # Strided views of the projection, read in place: the attention op reads q and the gate through their
            # strides (no copy launches in the decode step).
            q, gate = q.reshape(num_tokens, self.num_heads, 2, self.head_dim).unbind(dim=2)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        positions, table = batch.positions, self.cos_sin_cache
        if batch.rope_cos_sin is not None:
            positions, table = torch.arange(num_tokens, device=positions.device), batch.rope_cos_sin
        out = self._fused.qk_norm_rope_attention(
            q, k, v, positions, table, self.q_norm_weight, self.k_norm_weight, self.norm_eps,
            k_cache, v_cache, batch, self.scale, gate,
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def weight_slots(self) -> WeightSlots:
        slots = {**self.qkv_proj.weight_slots(), **prefixed("o_proj.", self.o_proj.weight_slots())}
        if self.q_norm_weight is not None and self.k_norm_weight is not None:
            slots["q_norm.weight"] = WeightSlot(self.q_norm_weight, WeightInit.ONES, self.norm_offset)
            slots["k_norm.weight"] = WeightSlot(self.k_norm_weight, WeightInit.ONES, self.norm_offset)
        return slots
