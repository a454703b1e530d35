"""What the server needs from the model directory: tokenizer, chat template, EOS ids, sampling defaults, the
served name.

The server does not read the model from its own config: it learns the model directory from the worker,
through the scheduler's first ready `Pong` (`ModelInfo.model_dir`), and loads these assets then (in a
thread, off the event loop). Until they are loaded, /ready answers 503 and generation answers 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from infer_protocol.config import Config, hub_repo_id
from infer_protocol.messages import ModelInfo, Pong

from infer_server.chat_template import ChatTemplate, ChatTemplateError
from infer_server.openai_models import GenerationFields
from infer_server.tokenizer import Tokenizer
from infer_server.vision_spec import VisionSpec, read_vision_spec

log = logging.getLogger(__name__)

# The sampling fields of generation_config.json that become the defaults of requests that leave them unset, as
# vLLM's `--generation-config auto` does (the model's authors tuned them; OpenAI's defaults are not).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelAssets:
    info: ModelInfo
    served_name: str
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    chat_template_error: str | None  # why there is no usable template (None = there is none at all)
    eos_token_ids: tuple[int, ...]
    aliases: frozenset[str]  # names a request's `model` may use for this model
    # request field -> value for requests that leave it unset (from generation_config.json; empty = OpenAI's)
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    vision: VisionSpec | None = None  # the image processor's settings; None: the model takes no images
    no_vision: str = "its config.json declares no vision_config"  # why `vision` is None

    @property
    def model_dir(self) -> str:
        return str(self.info.model_dir)

    @property
    def max_model_len(self) -> int:
        return int(self.info.max_model_len)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size or self.tokenizer.vocab_size


def served_model_name(config: Config, model_dir: str | None) -> str | None:
    """config.model_name, else a Hub repo id as configured (as vLLM serves it: the worker's directory is a
    snapshot named by its commit), else the model directory's basename (from the worker, else from the config)."""
    if config.model_name:
        return config.model_name
    repo_id = hub_repo_id(config.model)
    if repo_id is not None:
        return repo_id
    source = model_dir or config.model
    if source:
        return os.path.basename(os.path.normpath(source))
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def read_eos_token_ids(model_dir: str | Path, tokenizer: Tokenizer | None = None) -> list[int]:
    """EOS ids from generation_config.json (int or list) plus config.json; else the tokenizer's eos_token."""
    model_dir = Path(model_dir)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        data = _read_json(model_dir / name)
        ids.extend(_ids(data.get("eos_token_id")))
        text_config = data.get("text_config")
        if isinstance(text_config, dict):
            ids.extend(_ids(text_config.get("eos_token_id")))
    if not ids and tokenizer is not None and tokenizer.eos_token:
        eos = tokenizer.token_to_id(tokenizer.eos_token)
        if eos is not None:
            ids.append(eos)
    return list(dict.fromkeys(ids))


def read_generation_defaults(model_dir: str | Path) -> dict[str, float]:
    """The sampling fields generation_config.json sets, each checked as a request's own value would be; one the
    request schema refuses is left out, with a warning."""
    data = _read_json(Path(model_dir) / "generation_config.json")
    defaults: dict[str, float] = {}
    for name in GENERATION_DEFAULT_FIELDS:
        if data.get(name) is None:
            continue
        try:
            defaults[name] = getattr(GenerationFields.model_validate({name: data[name]}), name)
        except ValidationError:
            log.warning("generation_config.json in %s: %s = %r is not a valid request value; ignored", model_dir,
                        name, data[name])
    return defaults


def load_model_assets(info: ModelInfo, config: Config) -> ModelAssets:
    """Read tokenizer, template, EOS ids and sampling defaults from `info.model_dir` (blocking: run it in a
    thread)."""
    model_dir = Path(info.model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist on the server's machine")
    tokenizer = Tokenizer.from_dir(model_dir)
    tokenizer.precompute()
    template: ChatTemplate | None = None
    template_error: str | None = None
    try:
        template = ChatTemplate.from_model_dir(model_dir, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    except (ChatTemplateError, OSError, ValueError) as exc:
        template_error = str(exc)
        log.error("chat template of %s unusable: %s", model_dir, exc)
    name = served_model_name(config, info.model_dir) or model_dir.name
    aliases = {name, info.model_dir, model_dir.name, str(model_dir)}
    if config.model:
        aliases.add(config.model)
    return ModelAssets(
        info=info,
        served_name=name,
        tokenizer=tokenizer,
        chat_template=template,
        chat_template_error=template_error,
        eos_token_ids=tuple(read_eos_token_ids(model_dir, tokenizer)),
        aliases=frozenset(a for a in aliases if a),
        sampling_defaults=read_generation_defaults(model_dir) if config.generation_config == "auto" else {},
        **_vision(info, read_vision_spec(model_dir, tokenizer)),
    )


def _vision(info: ModelInfo, spec: VisionSpec | None) -> dict[str, Any]:
    """Images are served when the model has a vision config and the worker runs its tower (ModelInfo.images)."""
    if spec is not None and not info.images:
        return {"vision": None, "no_vision": "the worker does not run its vision tower"}
    return {"vision": spec}


class ModelAssetsLoader:
    """Loads the assets once a ready Pong names the model directory (again if the directory changes)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._assets: ModelAssets | None = None
        self._loading: asyncio.Task[None] | None = None
        self._failed_dir: str | None = None
        self.error: str | None = None

    @property
    def assets(self) -> ModelAssets | None:
        return self._assets

    def on_pong(self, pong: Pong) -> None:
        info = pong.model
        if not pong.ready or info is None or self._loading is not None:
            return
        current = self._assets
        if current is not None and current.info == info:
            return
        if info.model_dir == self._failed_dir:
            return  # do not retry a directory that failed, every heartbeat
        self._loading = asyncio.get_running_loop().create_task(self._load(info), name="rustinfer-load-assets")

    async def _load(self, info: ModelInfo) -> None:
        try:
            assets = await asyncio.to_thread(load_model_assets, info, self.config)
        except Exception as exc:
            self._failed_dir = info.model_dir
            self.error = f"cannot load tokenizer/template from {info.model_dir}: {exc}"
            log.error("%s", self.error)
        else:
            self._assets = assets
            self._failed_dir = None
            self.error = None
            log.info(
                "model assets loaded: %s (max_model_len %d, eos ids %s, chat template %s, images %s)",
                assets.served_name, assets.max_model_len, list(assets.eos_token_ids),
                "yes" if assets.chat_template else "no", "yes" if assets.vision else "no",
            )
            if assets.sampling_defaults:
                log.info("generation defaults from generation_config.json: %s",
                         ", ".join(f"{name}={value}" for name, value in assets.sampling_defaults.items()))
        finally:
            self._loading = None

    async def close(self) -> None:
        if self._loading is not None:
            self._loading.cancel()
            try:
                await self._loading
            except (asyncio.CancelledError, Exception):
                pass
