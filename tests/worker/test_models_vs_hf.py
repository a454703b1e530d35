"""The oracle: our models, run through ModelRunner on a paged KV cache, against HF transformers on the same
weights — fp32 logits close, greedy tokens identical through ragged batches, chunked prefill and prefix reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from infer_worker.components.rotary import RopeScaling, inverse_frequencies
from tests.worker.tiny_checkpoints import CONFIGS, Engine, hf_greedy, llama_config, write_checkpoint

DECODE_STEPS = 16


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp(request.param)
    return path, write_checkpoint(CONFIGS[request.param](), path, seed=7)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_logits_match_hf(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    path, hf = checkpoint
    engine = Engine.open(path)
    prompt = _prompt(23, seed=1)
    ours = engine.prefill_logits(prompt)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_greedy_decode_matches_hf_generate(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    path, hf = checkpoint
    engine = Engine.open(path)
    prompt = _prompt(9, seed=2)
    seq = engine.new_seq(0, prompt)
    engine.step([(seq, len(prompt))])
    engine.decode([seq], DECODE_STEPS - 1)
    assert seq.token_ids[len(prompt):] == hf_greedy(hf, prompt, DECODE_STEPS)


def test_ragged_batch_of_two_lengths_matches_hf(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    path, hf = checkpoint
    engine = Engine.open(path)
    prompts = [_prompt(13, seed=3), _prompt(5, seed=4)]
    seqs = [engine.new_seq(i, p) for i, p in enumerate(prompts)]
    engine.step([(s, s.num_tokens) for s in seqs])  # one ragged prefill of both
    engine.decode(seqs, DECODE_STEPS - 1)  # ragged decode: contexts of different lengths
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == hf_greedy(hf, prompt, DECODE_STEPS)


def test_chunked_prefill_mixed_with_decode_matches_hf(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    path, hf = checkpoint
    engine = Engine.open(path)
    long_prompt, short_prompt = _prompt(14, seed=5), _prompt(6, seed=6)
    long_seq, short_seq = engine.new_seq(0, long_prompt), engine.new_seq(1, short_prompt)
    engine.step([(short_seq, len(short_prompt))])
    # The long prompt arrives in chunks of 5, 6 and 3 tokens (chunks cross page boundaries), each chunk
    # batched with a decode step of the short sequence; only the last chunk samples.
    for chunk in (5, 6):
        sampled = engine.step([(short_seq, 1), (long_seq, chunk)])
        assert list(sampled) == [1]
    sampled = engine.step([(long_seq, 3), (short_seq, 1)])
    assert list(sampled) == [0, 1]
    engine.decode([long_seq, short_seq], DECODE_STEPS - 1)
    assert long_seq.token_ids[len(long_prompt):] == hf_greedy(hf, long_prompt, DECODE_STEPS)
    assert short_seq.token_ids[len(short_prompt):] == hf_greedy(hf, short_prompt, 3 + DECODE_STEPS)


def test_prefix_cached_start_matches_hf(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    path, hf = checkpoint
    engine = Engine.open(path)
    shared = _prompt(8, seed=8)  # two full pages of 4
    first_prompt, second_prompt = shared + _prompt(3, seed=9), shared + _prompt(6, seed=10)
    first = engine.new_seq(0, first_prompt)
    engine.step([(first, len(first_prompt))])
    engine.decode([first], 2)
    # The second sequence reuses the first one's two full prefix pages: its KV is already in the cache.
    second = engine.new_seq(1, second_prompt)
    second.block_ids = first.block_ids[:2]
    second.num_computed = len(shared)
    engine.step([(second, len(second_prompt) - len(shared)), (first, 1)])
    engine.decode([second, first], DECODE_STEPS - 1)
    assert second.token_ids[len(second_prompt):] == hf_greedy(hf, second_prompt, DECODE_STEPS)
    assert first.token_ids[len(first_prompt):] == hf_greedy(hf, first_prompt, 3 + DECODE_STEPS)


@pytest.mark.parametrize("head_dim,original", [(16, 64), (64, 8192), (128, 8192)])
def test_llama3_rope_frequencies_match_hf(head_dim: int, original: int) -> None:
    parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    config = llama_config(hidden_size=4 * head_dim, head_dim=head_dim, rope_parameters=parameters)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, original)
    assert attention_factor == 1.0
    torch.testing.assert_close(inverse_frequencies(head_dim, 500000.0, scaling), expected.float(), rtol=1e-6, atol=0)
