"""Tiny random HF checkpoints (written by transformers itself) and a small step driver for ModelRunner.

The oracle for every model test is HF transformers on the very same weights. Weights are drawn with a large
initializer range and non-unit norm scales so that (a) greedy logits are well separated (no near-ties that
float noise could flip) and (b) a mis-mapped norm or projection cannot hide behind an all-ones weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from infer_backend_cpu import CpuBackend
from infer_core.dtypes import DType
from infer_core.ports.fused_ops import AttentionBatch
from infer_worker.application.cache_layout import allocate_caches
from infer_worker.application.model_runner import HostStep, ModelRunner, prepare_step
from infer_worker.domain.sequence import GREEDY, Sampling, ScheduledSeq, Sequence
from infer_worker.infrastructure.model_loader import load_model
from infer_worker.models.causal_lm import CausalLM, StepImages
from infer_worker.models.spec import ModelSpec

def forward_step(runner: ModelRunner, step: HostStep, images: StepImages | None = None) -> torch.Tensor:
    """The hidden states of every position of a prepared step, by one direct `model.forward` on the runner's model
    and cache (the runner itself keeps only the sampling rows' logits); its inputs copied one by one. `images`:
    the step's image inputs (`ImageInputs.step`), for a prompt with images."""
    def dev(array: Any) -> torch.Tensor:
        return torch.from_numpy(array).to(runner.device)

    batch = AttentionBatch(positions=dev(step.positions), slot_mapping=dev(step.slot_mapping),
                           query_start_loc=dev(step.query_start_loc), seq_lens=dev(step.seq_lens),
                           block_tables=dev(step.block_tables), max_query_len=step.max_query_len,
                           max_seq_len=step.max_seq_len, is_decode=step.is_decode, block_size=runner.block_size)
    state_slots = None
    if runner.state_pools:  # a hybrid model: fresh sequences start from zeroed state slots, as in the runner
        assert step.state_slots is not None and step.fresh_slots is not None
        runner.backend.ops.gdn.reset_slots(runner.state_pools, dev(step.fresh_slots))
        state_slots = dev(step.state_slots)
    if images is not None:
        return runner.model.forward(dev(step.input_ids), batch, runner.kv_caches, state_slots, images)
    return runner.model.forward(dev(step.input_ids), batch, runner.kv_caches, state_slots)


_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,  # random models emit any token; no early stop in HF generate
    pad_token_id=None,
)


def llama_config(**overrides: Any) -> LlamaConfig:
    return LlamaConfig(**{**_COMMON, "num_hidden_layers": 2, **overrides})


def qwen3_config(tied: bool, **overrides: Any) -> Qwen3Config:
    return Qwen3Config(**{**_COMMON, "num_hidden_layers": 3, "head_dim": 32, "tie_word_embeddings": tied, **overrides})


# name -> config factory; every model test runs over all of them
CONFIGS: dict[str, Callable[[], LlamaConfig | Qwen3Config]] = {
    "llama": lambda: llama_config(),
    "llama3-rope-bias": lambda: llama_config(
        num_hidden_layers=3,
        num_key_value_heads=1,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,  # puts one band in the blend
        },
    ),
    "qwen3-tied": lambda: qwen3_config(tied=True),
    "qwen3-untied": lambda: qwen3_config(tied=False, num_key_value_heads=4),
}


def random_hf_model(config: LlamaConfig | Qwen3Config, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    cls = Qwen3ForCausalLM if isinstance(config, Qwen3Config) else LlamaForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model


def write_checkpoint(config: LlamaConfig | Qwen3Config, path: Path, seed: int = 0, max_shard_size: str | None = None) -> PreTrainedModel:
    model = random_hf_model(config, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def greedy_steps(runner: ModelRunner, seqs: list[Sequence], steps: int) -> None:
    """Prefill what is left of every sequence in one step, then decode them together: `steps` tokens each."""
    scheduled = [ScheduledSeq(s, s.num_tokens - s.num_computed) for s in seqs]
    for _ in range(steps):
        out = runner.execute(scheduled)
        for item, tok in zip(scheduled, out.token_ids, strict=True):
            item.seq.num_computed += item.num_new
            item.seq.token_ids.append(tok)
        scheduled = [ScheduledSeq(s, 1) for s in seqs]


@dataclass
class Engine:
    """A minimal stand-in for the scheduler: hands out pages, runs steps, appends sampled tokens."""

    model: CausalLM
    spec: ModelSpec
    runner: ModelRunner
    block_size: int
    free_blocks: list[int]
    free_state_slots: list[int]

    @classmethod
    def open(cls, model_dir: Path, block_size: int = 4, num_blocks: int = 96, dtype: DType = DType.FLOAT32,
             max_blocks_per_seq: int = 32, num_state_slots: int = 8) -> "Engine":
        backend = CpuBackend(device="cpu")
        model, spec = load_model(model_dir, backend, dtype, "auto", 0)
        caches = allocate_caches(backend, spec, num_blocks, block_size, dtype, num_state_slots, spec.num_kv_heads)
        runner = ModelRunner(model, backend, caches.per_layer, block_size, max_blocks_per_seq=max_blocks_per_seq,
                             device="cpu", state_pools=caches.state_pools)
        # Pages in a scrambled order, so that a sequence's pages are never contiguous in the cache.
        free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        return cls(model, spec, runner, block_size, free, list(range(num_state_slots, 0, -1)))

    def new_seq(self, seq_id: int, prompt: list[int], sampling: Sampling | None = None) -> Sequence:
        """A sequence with its own state slot (used by hybrid models only)."""
        seq = Sequence(seq_id, list(prompt), 0, [], sampling or GREEDY)
        if self.runner.state_pools:
            seq.state_slot = self.free_state_slots.pop()
        return seq

    def step(self, work: list[tuple[Sequence, int]]) -> dict[int, int]:
        """Compute `num_new` tokens of each sequence; returns seq_id -> sampled token (applied to the seq)."""
        for seq, num_new in work:
            needed = -(-(seq.num_computed + num_new) // self.block_size)
            while len(seq.block_ids) < needed:
                seq.block_ids.append(self.free_blocks.pop())
        out = self.runner.execute([ScheduledSeq(seq, n) for seq, n in work])
        for seq, num_new in work:
            seq.num_computed += num_new
        by_id = {seq.seq_id: seq for seq, _ in work}
        for seq_id, token in zip(out.seq_ids, out.token_ids):
            by_id[seq_id].token_ids.append(token)
        return dict(zip(out.seq_ids, out.token_ids))

    def prefill_logits(self, prompt: list[int]) -> torch.Tensor:
        """float32 logits of every prompt position `[len(prompt), vocab]` (one forward over fresh pages)."""
        seq = self.new_seq(-1, prompt)
        seq.block_ids = [self.free_blocks.pop() for _ in range(-(-len(prompt) // self.block_size))]
        step = prepare_step([ScheduledSeq(seq, len(prompt))], self.block_size, self.runner.max_blocks_per_seq)
        return self.model.compute_logits(forward_step(self.runner, step))

    def decode(self, seqs: list[Sequence], steps: int) -> None:
        for _ in range(steps):
            self.step([(seq, 1) for seq in seqs])
