"""The e2e fixtures (`embedded_model_dir`, `smol_cluster`) live in tests/conftest.py: the frontend's
browser tests share the same session-wide cluster. Here: a tiny random checkpoint for the tests that need
real processes but not a real model (fault injection, fuzzing)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import ServedCluster

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_tiny_llama(path: Path, tokenizer_dir: Path, *, layers: int = 1) -> Path:
    """A random Llama of a few million parameters with the embedded model's tokenizer and chat template."""
    import torch
    import transformers

    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.5, bos_token_id=1, eos_token_id=2,
        rope_theta=10000.0, tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir / extra).exists():
            shutil.copy(tokenizer_dir / extra, path / extra)
    return path


TINY_VERSION = 1  # bump when write_tiny_llama changes: the checkpoint is cached under this name


@pytest.fixture(scope="session")
def tiny_model_dir(embedded_model_dir: Path) -> Path:
    """Written once (importing transformers costs tens of seconds on 2 loaded cores) and kept next to the
    embedded model's conversion; a finished directory is renamed into place, so a crash leaves no half."""
    cached = embedded_model_dir.parent.parent / "test-models" / f"tiny-llama-v{TINY_VERSION}"
    if not (cached / "config.json").exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.parent / f".{cached.name}.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        write_tiny_llama(partial, embedded_model_dir)
        try:
            partial.rename(cached)
        except OSError:  # another session won the race
            shutil.rmtree(partial, ignore_errors=True)
    return cached


@pytest.fixture(scope="session")
def tiny_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    """The tiny checkpoint served as "tiny" with a small KV cache (128 blocks of 4 tokens) and context (256),
    shared by the fuzzing and disconnect tests; a test that needs other limits starts a cluster of its own."""
    cluster = ServedCluster(tmp_path_factory.mktemp("tiny-cluster"), model=str(tiny_model_dir), model_name="tiny",
                            num_blocks=128, block_size=4, max_model_len=256, max_batch_seqs=32,
                            request_timeout_secs=120.0)
    cluster.start(timeout=300)
    yield cluster
    cluster.stop()
