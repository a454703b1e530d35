"""Chat templates: where they come from, how they render, and the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer_server.chat_template import ChatTemplate, ChatTemplateError, find_template_source
from tests.server.tiny_model import CHAT_TEMPLATE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_renders_chatml_with_generation_prompt() -> None:
    t = ChatTemplate(CHAT_TEMPLATE)
    assert t.render(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not t.render(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_bos_eos_tokens_and_helpers() -> None:
    src = "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}{{ eos_token }}{{ strftime_now('%Y')|length }}"
    t = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    assert t.render([{"role": "user", "content": "é<b>"}]) == '<s>"é<b>"</s>4'


def test_loop_controls_and_trim_blocks() -> None:
    src = "{% for m in messages %}\n{% if loop.index > 1 %}{% break %}{% endif %}\n{{ m.role }}\n{% endfor %}"
    assert ChatTemplate(src).render(MESSAGES) == "system\n"


def test_raise_exception_refuses() -> None:
    src = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        ChatTemplate(src).render(MESSAGES)


@pytest.mark.parametrize(
    "src",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set x = messages.append({'role': 'user'}) %}",  # immutable sandbox: no mutation of inputs
    ],
)
def test_sandbox_refuses_unsafe_templates(src: str) -> None:
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe"):
        ChatTemplate(src).render(MESSAGES)


def test_syntax_error_is_a_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_sources_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from-config"}))
    assert find_template_source(tmp_path) == "from-config"
    (tmp_path / "chat_template.jinja").write_text("from-file")
    assert find_template_source(tmp_path) == "from-file"


def test_named_templates_and_missing(tmp_path: Path) -> None:
    assert find_template_source(tmp_path) is None
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert find_template_source(tmp_path) == "D"
