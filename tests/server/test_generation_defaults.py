"""generation_config.json's sampling fields are the defaults of requests that leave them out; a request's own
value wins, even when it is OpenAI's default; `generation_config = "none"` turns them off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infer_protocol.config import load_config
from infer_protocol.messages import ModelInfo, SamplingParams
from infer_server.model_assets import ModelAssets, load_model_assets, read_generation_defaults
from infer_server.openai_models import ChatCompletionRequest
from infer_server.params import build_params
from tests.server.tiny_model import write_model_dir

QWEN3_STYLE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
               "do_sample": True, "max_new_tokens": 2048}


def _model_dir(path: Path, sampling: dict[str, Any]) -> Path:
    model_dir = write_model_dir(path)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(config | sampling))
    return model_dir


def _assets(model_dir: Path, **config: Any) -> ModelAssets:
    info = ModelInfo(model_dir=str(model_dir), max_model_len=128, vocab_size=0, backend="cpu", device="cpu",
                     dtype="float32")
    return load_model_assets(info, load_config(environ={}, overrides=config))


def _sampling(assets: ModelAssets, **fields: Any) -> SamplingParams:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]} | fields)
    [params] = build_params(req, [5, 6, 7], 8, assets, load_config(environ={}), what="messages", param="messages")
    return params.sampling


def _fields(s: SamplingParams) -> tuple[float, float, int, float, float]:
    return s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty


def test_the_model_sampling_fields_are_read(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path / "m", QWEN3_STYLE)
    assert read_generation_defaults(model_dir) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                                   "repetition_penalty": 1.1}
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 0.0, "top_k": 5}))
    assert read_generation_defaults(model_dir) == {"top_k": 5}  # what a request could not send is left out
    (model_dir / "generation_config.json").unlink()
    assert read_generation_defaults(model_dir) == {}


def test_unset_fields_take_the_model_defaults_and_set_ones_win(tmp_path: Path) -> None:
    assets = _assets(_model_dir(tmp_path / "m", QWEN3_STYLE))
    assert _fields(_sampling(assets)) == (0.6, 0.95, 20, 0.05, 1.1)
    assert _fields(_sampling(assets, temperature=None, top_k=None)) == (0.6, 0.95, 20, 0.05, 1.1)  # null = unset
    # OpenAI's own defaults, sent explicitly, are the request's values, not "unset"
    assert _fields(_sampling(assets, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)) == (
        1.0, 1.0, 0, 0.0, 1.0)
    assert _fields(_sampling(assets, temperature=0)) == (0.0, 0.95, 20, 0.05, 1.1)  # one field, the rest stay


@pytest.mark.parametrize("sampling", [QWEN3_STYLE, {}])
def test_none_or_a_model_without_sampling_fields_keeps_the_openai_defaults(tmp_path: Path,
                                                                           sampling: dict[str, Any]) -> None:
    model_dir = _model_dir(tmp_path / "m", sampling)
    assets = _assets(model_dir, generation_config="none" if sampling else "auto")
    assert assets.sampling_defaults == {}
    assert _fields(_sampling(assets)) == (1.0, 1.0, 0, 0.0, 1.0)
