"""Served greedy tokens equal HF transformers' on tiny random Llama and Qwen3 checkpoints the test writes
itself (with the embedded model's real tokenizer, so the server side is the real one too)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import ServedCluster

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _write_checkpoint(kind: str, path: Path, tokenizer_dir: Path) -> None:
    import torch
    import transformers

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(1234)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True, rope_theta=1000000.0)
        model = transformers.Qwen3ForCausalLM(config)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_served_greedy_tokens_equal_hf(kind: str, tmp_path: Path, embedded_model_dir: Path) -> None:
    import torch
    import transformers

    model_dir = tmp_path / f"tiny-{kind}"
    _write_checkpoint(kind, model_dir, embedded_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    prompts = [[1, 450, 7042, 282, 4649, 314], [1, 22, 33, 44], list(range(100, 140))]
    cluster = ServedCluster(tmp_path, model=str(model_dir), model_name="tiny", block_size=4).start()
    try:
        for prompt in prompts:
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            expected = out[0, len(prompt):].tolist()
            resp = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
                "return_token_ids": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == expected
    finally:
        cluster.stop()
