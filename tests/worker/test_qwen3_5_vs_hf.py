"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) against transformers on the same tiny random checkpoint in
the published layout: fp32 logits close over prompts spanning several prefill chunks, and greedy tokens
identical, alone and in ragged batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from infer_worker.application.model_runner import prepare_step
from infer_worker.domain.sequence import ScheduledSeq
from infer_worker.models.spec import FULL_ATTENTION, LINEAR_ATTENTION
from tests.worker.qwen3_5_checkpoints import write_qwen3_5
from tests.worker.tiny_checkpoints import Engine, forward_step, hf_greedy

DECODE_STEPS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3_5ForConditionalGeneration]:
    path = tmp_path_factory.mktemp("qwen3_5")
    return path, write_qwen3_5(path, seed=3)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_spec_reads_the_text_config_and_layer_types(checkpoint) -> None:
    path, _ = checkpoint
    spec = Engine.open(path).spec
    assert spec.mixers == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert (spec.rotary_dim, spec.head_dim, spec.attention_output_gate, spec.norm_offset) == (8, 32, True, 1.0)
    assert spec.tie_word_embeddings and spec.linear_attention is not None and spec.linear_attention.conv_dim == 128


def test_logits_of_a_prompt_prefilled_in_chunks_match_transformers(checkpoint) -> None:
    """150 tokens in chunks of 50: the GDN's WY chunks (64) and our prefill chunks cut the prompt differently,
    and every chunk after the first starts from the conv and recurrent state the one before left.
    The oracle is transformers in float64: in float32 both it and we land ~2e-4 from it on logits up to ~7 (the
    chunked delta rule's triangular solves), so float32 against float32 sat at the tolerance and failed a CI run
    that allocated differently; 1e-3 is 5x that error, and a mis-mapped weight, norm or state moves logits by 0.1+."""
    path, hf = checkpoint
    engine = Engine.open(path, num_blocks=64, max_blocks_per_seq=48)
    prompt = _prompt(150, seed=1)
    with torch.no_grad():
        expected = hf.double()(torch.tensor([prompt])).logits[0].float()
        hf.float()
    seq = engine.new_seq(0, prompt)
    for start in range(0, len(prompt), 50):
        while len(seq.block_ids) < -(-(start + 50) // engine.block_size):
            seq.block_ids.append(engine.free_blocks.pop())
        step = prepare_step([ScheduledSeq(seq, 50)], engine.block_size, engine.runner.max_blocks_per_seq)
        logits = engine.model.compute_logits(forward_step(engine.runner, step))
        torch.testing.assert_close(logits, expected[start:start + 50], atol=1e-3, rtol=1e-3)
        seq.num_computed += 50


def test_greedy_decode_matches_transformers_generate(checkpoint) -> None:
    path, hf = checkpoint
    engine = Engine.open(path)
    prompt = _prompt(11, seed=2)
    seq = engine.new_seq(0, prompt)
    engine.step([(seq, len(prompt))])
    engine.decode([seq], DECODE_STEPS - 1)
    assert seq.token_ids[len(prompt):] == hf_greedy(hf, prompt, DECODE_STEPS)


def test_ragged_batch_of_mixed_prefill_and_decode_matches_transformers(checkpoint) -> None:
    """Three sequences, each in its own state slot: a ragged prefill, one joining mid-way (a step of one
    sequence's prefill next to the others' decodes), then decodes of different context lengths."""
    path, hf = checkpoint
    engine = Engine.open(path)
    prompts = [_prompt(13, seed=3), _prompt(5, seed=4), _prompt(70, seed=5)]
    seqs = [engine.new_seq(i, p) for i, p in enumerate(prompts)]
    engine.step([(seqs[0], 13), (seqs[1], 5)])
    engine.step([(seqs[0], 1), (seqs[1], 1), (seqs[2], 40)])
    engine.step([(seqs[0], 1), (seqs[1], 1), (seqs[2], 30)])
    engine.decode(seqs, DECODE_STEPS - 1)
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):len(prompt) + DECODE_STEPS - 1] == hf_greedy(hf, prompt, DECODE_STEPS - 1)


def test_the_text_only_layout_and_an_mtp_head_load_to_the_same_model(checkpoint, tmp_path: Path) -> None:
    """`Qwen3_5ForCausalLM` keeps the text model under `model.`; the published checkpoint's `mtp.*` tensors are
    not the text path's and are skipped, like `model.visual.*`."""
    import json

    from safetensors.torch import load_file, save_file

    path, hf = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    text_only = {name.replace("model.language_model.", "model.", 1): t for name, t in tensors.items()
                 if not name.startswith("model.visual.")}
    text_only["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(text_only, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    text_config = {**config["text_config"], "architectures": ["Qwen3_5ForCausalLM"], "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(text_config))
    prompt = _prompt(30, seed=9)
    engine = Engine.open(tmp_path)
    assert engine.spec.architecture == "Qwen3_5ForCausalLM"
    ours = engine.prefill_logits(prompt)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=2e-4)
