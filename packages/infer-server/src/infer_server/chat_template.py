"""The model's chat template, rendered in a sandbox.

The template comes from the model directory: `chat_template.jinja`, else `chat_template` in
`tokenizer_config.json` (a string, or a list of named templates of which "default" is taken). It is
rendered like HF transformers does (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII) but in an immutable sandbox whose unsafe attribute access
(`__class__`, `__globals__`, ...) raises instead of quietly rendering as empty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2.ext
import jinja2.meta
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infer_server.tokenizer import read_tokenizer_config


class ChatTemplateError(ValueError):
    """The template could not be loaded, refused to render (raise_exception) or broke the sandbox."""


class _StrictSandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template with the model's BOS/EOS strings."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        env = _environment()
        try:
            self._template = env.from_string(source)
            self._variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None

    def reads(self, variable: str) -> bool:
        """Whether the template reads this render variable (e.g. `tools`: whether it can show tools at all)."""
        return variable in self._variables

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, bos_token: str | None = None,
                       eos_token: str | None = None) -> ChatTemplate | None:
        """The directory's template, or None when it has none."""
        source = find_template_source(model_dir)
        if source is None:
            return None
        return cls(source, bos_token=bos_token, eos_token=eos_token)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except SecurityError as exc:
            raise ChatTemplateError(f"the chat template was refused by the sandbox: {exc}") from None
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from None


def find_template_source(model_dir: str | Path) -> str | None:
    model_dir = Path(model_dir)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = read_tokenizer_config(model_dir).get("chat_template")
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str) and chosen:
            return chosen
    json_file = model_dir / "chat_template.json"  # processor-style {"chat_template": "..."}
    if json_file.is_file():
        data = json.loads(json_file.read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
            return str(data["chat_template"])
    return None


__all__ = ["ChatTemplate", "ChatTemplateError", "find_template_source"]
