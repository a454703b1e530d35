"""Model assets: EOS ids, served name and aliases, loading from the directory the worker names."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from infer_protocol.config import load_config
from infer_protocol.messages import ModelInfo
from infer_server.model_assets import load_model_assets, read_eos_token_ids, served_model_name
from infer_server.openai_models import ChatMessage
from infer_server.prompts import chat_prompt_ids
from infer_server.tokenizer import Tokenizer
from tests.server.tiny_model import write_model_dir


def test_eos_ids_from_generation_config_and_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 6}))
    assert read_eos_token_ids(tmp_path) == [5, 6]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert read_eos_token_ids(tmp_path) == [9, 6]


def test_eos_falls_back_to_the_tokenizer(tmp_path: Path, tokenizer: Tokenizer) -> None:
    assert read_eos_token_ids(tmp_path, tokenizer) == [tokenizer.token_to_id("<|im_end|>")]


def test_served_name() -> None:
    assert served_model_name(load_config(environ={}, overrides={"model_name": "x"}), "/a/b") == "x"
    assert served_model_name(load_config(environ={}), "/models/SmolLM2-135M/") == "SmolLM2-135M"
    assert served_model_name(load_config(environ={}), None) is None



def test_a_hub_id_is_served_under_the_repo_id(tmp_path: Path) -> None:
    """The worker's directory for a Hub id is a snapshot named by its commit: the repo id is the name (as vLLM)."""
    snapshot = "/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/" + "c" * 40
    hub = load_config(environ={}, overrides={"model": "Qwen/Qwen3-0.6B"})
    assert served_model_name(hub, snapshot) == "Qwen/Qwen3-0.6B"
    assert served_model_name(load_config(environ={}, overrides={"model": "Qwen/Qwen3-0.6B", "model_name": "q"}),
                             snapshot) == "q"
    local = tmp_path / "Qwen" / "Qwen3-0.6B"
    local.mkdir(parents=True)  # a directory spelled like a Hub id is a directory: its name is served
    assert served_model_name(load_config(environ={}, overrides={"model": str(local)}), str(local)) == "Qwen3-0.6B"
    d = write_model_dir(tmp_path / "snapshots" / ("c" * 40))
    info = ModelInfo(model_dir=str(d), max_model_len=64, vocab_size=0, backend="cpu", device="cpu", dtype="float32")
    assets = load_model_assets(info, hub)
    assert assets.served_name == "Qwen/Qwen3-0.6B" and "Qwen/Qwen3-0.6B" in assets.aliases


def test_load_assets(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m")
    info = ModelInfo(model_dir=str(d), max_model_len=64, vocab_size=0, backend="cpu", device="cpu", dtype="float32")
    assets = load_model_assets(info, load_config(environ={}))
    assert assets.served_name == "m" and assets.max_model_len == 64
    assert assets.vocab_size == assets.tokenizer.vocab_size  # 0 from the worker = the tokenizer's
    assert assets.chat_template is not None and assets.chat_template.eos_token == "<|im_end|>"
    assert len(assets.eos_token_ids) == 2
    assert {"m", str(d)} <= assets.aliases


class _NoTableScans:
    """A tokenizers.Tokenizer stand-in that refuses the whole-vocabulary calls and forwards the rest."""

    def __init__(self, hf: object) -> None:
        self._hf = hf

    def get_vocab(self, *_: object, **__: object) -> None:
        raise AssertionError("the vocabulary was scanned while serving a request")

    def get_added_tokens_decoder(self) -> None:
        raise AssertionError("the added tokens were scanned while serving a request")

    def __getattr__(self, name: str) -> object:
        return getattr(self._hf, name)


def test_loaded_assets_serve_the_first_chat_without_a_vocabulary_scan(tmp_path: Path) -> None:
    """The tokenizer tables built on first use (special tokens, the longest piece: ~0.16 s for Qwen3's 151k
    vocabulary) are built while the assets load, so the first request of each server process does not stall its
    event loop (it did: client TTFT p99 of 90-225 ms at qps 1 and 8, against a server TTFT under 40 ms)."""
    d = write_model_dir(tmp_path / "m")
    info = ModelInfo(model_dir=str(d), max_model_len=64, vocab_size=0, backend="cpu", device="cpu", dtype="float32")
    assets = load_model_assets(info, load_config(environ={}))
    fresh = Tokenizer.from_dir(d)
    assets.tokenizer._hf = _NoTableScans(assets.tokenizer._hf)  # type: ignore[assignment]
    ids = chat_prompt_ids(assets, [ChatMessage(role="user", content="hi <|im_end|> there")], True)
    assert ids == chat_prompt_ids(replace(assets, tokenizer=fresh), [ChatMessage(role="user",
                                                                               content="hi <|im_end|> there")], True)
    assert assets.tokenizer.max_token_chars == fresh.max_token_chars and fresh.max_token_chars is not None
    assert assets.tokenizer.special_tokens == fresh.special_tokens and fresh.special_tokens


def test_the_copy_that_keeps_special_token_text_as_text_is_built_before_a_request_needs_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building it took ~1.4 s for Qwen3's tokenizer: left to the first message holding special-token text, that
    request and every stream of its server process would wait a second."""
    import infer_server.tokenizer as tokenizer_module

    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "m"))
    build = tok.precompute()
    assert build is not None
    build.join(30)

    class NoBuild:
        @staticmethod
        def from_str(_: str) -> None:
            raise AssertionError("the literal copy was built while serving a request")

    monkeypatch.setattr(tokenizer_module, "HfTokenizer", NoBuild)
    ids = tok.encode("<|im_end|>", add_special_tokens=False, special_tokens_as_text=True)
    assert len(ids) > 1 and tok.token_to_id("<|im_end|>") not in ids
