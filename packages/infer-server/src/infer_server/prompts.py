"""Prompts to token ids: chat messages through the model's template, and completion prompts; off the event loop.

**Off the loop.** Tokenizing a long prompt takes seconds of CPU (1.8 s for 1.3 million words), rendering a
template some more; done on the event loop it stalls every other request and stream of the process. So
`off_loop` runs such work in a worker thread (`Tokenizer.encode` releases the GIL there). A text that cannot fit the
context whatever its tokens (`Tokenizer.max_token_chars`) is refused before it is tokenized at all.

**Content is text.** The chat template writes the control tokens (`<|im_start|>`, `<|im_end|>`); a message's
content must not: a user who types `<|im_end|><|im_start|>system` would otherwise forge a system turn. The
template is rendered as usual; when some content holds a special token's text, it is rendered once more with a
random marker around each content string, which locates the content in the text. The text is then split at the
template's own special tokens (as HF splits any text at added tokens before tokenizing the pieces between them), and
each piece between them, content included, is tokenized with special-token text as ordinary text. Content without
special-token text takes the plain path (the same ids by construction). `allow_special_tokens_in_content` turns
this off. A completion's prompt is the caller's raw text: its special-token text is parsed, as vLLM does.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from infer_server.chat_template import ChatTemplate, ChatTemplateError
from infer_server.errors import invalid_request
from infer_server.model_assets import ModelAssets
from infer_server.openai_models import ChatMessage
from infer_server.params import check_text_fits, template_messages
from infer_server.tokenizer import Tokenizer
from infer_server.tool_calls import FORMATS
from infer_server.tools import ToolRendering, rendering_for, tool_turn, with_tools_prompt

T = TypeVar("T")

# Below this many characters, tokenizing costs about as much as a few thread hops (~45 us each): inline. Above it
# the cost grows faster than the text (Qwen3's tokenizer on plain words, 2-core VM: 2,000 chars 0.38 ms, 8,000 2.0
# ms, 16,000 6.6 ms), and on the loop it would hold back every other stream of the process for that long: a
# ~3,000-token prompt (~6,000 chars) stalled them ~1.5 ms when this was 16,384.
OFF_LOOP_CHARS = 2_048


async def off_loop(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a worker thread when its input is `size` >= OFF_LOOP_CHARS characters, else inline."""
    if size < OFF_LOOP_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def messages_size(messages: Sequence[ChatMessage]) -> int:
    """The characters of the messages' text (what rendering and tokenizing them costs)."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(p.text or "") for p in m.content)
    return total


def _template(assets: ModelAssets) -> ChatTemplate:
    template = assets.chat_template
    if template is None:
        detail = assets.chat_template_error or "the model directory has no chat template"
        raise invalid_request(f"This model cannot serve chat completions: {detail}. Use /v1/completions.",
                              param="messages", code="chat_template_missing")
    return template


def _render(template: ChatTemplate, msgs: list[dict[str, Any]], add_generation_prompt: bool,
            extra: dict[str, Any]) -> str:
    try:
        return template.render(msgs, add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), param="messages", code="chat_template_error") from None


def chat_prompt_ids(assets: ModelAssets, messages: list[ChatMessage], add_generation_prompt: bool,
                    rendering: ToolRendering | None = None, *, add_special_tokens: bool = False,
                    literal_content: bool = True, check_fits: bool = True, images: bool = False) -> list[int]:
    """Chat messages -> prompt token ids through the model's template (400 when it has none or it refuses).
    `rendering`: how the tools and tool turns reach the template (default: no tools, Hermes-style tool turns for a
    template without its own); `literal_content`: special-token text in content stays text; `check_fits`: refuse a
    text certain to exceed the context before tokenizing it (not for /tokenize, which counts the tokens of any
    text); `images`: image parts go to the template, which writes one placeholder token for each (else they are
    refused)."""
    template = _template(assets)
    rendering = rendering or rendering_for(template, FORMATS["hermes"])
    msgs = [tool_turn(m, i, item, rendering)
            for i, (m, item) in enumerate(zip(messages, template_messages(messages, images=images), strict=True))]
    msgs = with_tools_prompt(msgs, rendering)
    extra = {"tools": list(rendering.tools)} if rendering.tools and rendering.native_tools else {}
    text = _render(template, msgs, add_generation_prompt, extra)
    if check_fits:
        check_text_fits(text, assets, what="messages", param="messages")
    tok = assets.tokenizer
    pattern = tok.special_token_pattern
    if not literal_content or pattern is None:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    for i, m in enumerate(msgs):
        name = m.get("name")
        if isinstance(name, str) and pattern.search(name):
            raise invalid_request(f"'messages[{i}].name' holds the special token text "
                                  f"{pattern.search(name).group()!r}", param="messages")  # type: ignore[union-attr]
    if not any(pattern.search(piece) for m in msgs for piece in _texts(m["content"])):
        return tok.encode(text, add_special_tokens=add_special_tokens)
    ids = literal_content_ids(tok, template, msgs, add_generation_prompt, text, extra)
    return _with_added_special_tokens(tok, ids) if add_special_tokens else ids


def literal_content_ids(tok: Tokenizer, template: ChatTemplate, msgs: list[dict[str, Any]],
                        add_generation_prompt: bool, text: str, extra: dict[str, Any] | None = None) -> list[int]:
    """The ids of `text` (the messages rendered by `template`, with the render variables `extra`) in which only the
    template's own special tokens are special: the content's special-token text is tokenized as text."""
    spans = _content_spans(template, msgs, add_generation_prompt, text, extra or {})
    pattern = tok.special_token_pattern
    by_text = {t.content: t for t in tok.special_tokens}
    # Cut the text at the template's special tokens (outside every content span), as HF cuts it at added tokens.
    pieces: list[str | int] = []  # text to tokenize, or a special token's id
    pos = 0
    for start, end in _template_gaps(spans, len(text)):
        for match in pattern.finditer(text, start, end) if pattern is not None else ():
            special = by_text[match.group()]
            before = text[pos:match.start()]
            pieces.append(before.rstrip() if special.lstrip else before)
            pieces.append(special.id)
            pos = match.end()
            if special.rstrip:
                while pos < len(text) and text[pos].isspace():
                    pos += 1
    pieces.append(text[pos:])
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids.append(piece)
        elif piece:
            ids.extend(tok.encode(piece, add_special_tokens=False, special_tokens_as_text=True))
    return ids


def _template_gaps(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    gaps, pos = [], 0
    for start, end in spans:
        gaps.append((pos, start))
        pos = end
    gaps.append((pos, length))
    return gaps


def _content_spans(template: ChatTemplate, msgs: list[dict[str, Any]], add_generation_prompt: bool,
                   text: str, extra: dict[str, Any]) -> list[tuple[int, int]]:
    """Where the content strings lie in `text`: rendered again with a random marker pair around each content. A
    template that changes the content (strips, splits it) moves or breaks the markers; the content then cannot be
    located with certainty, and its special-token text is refused rather than guessed at."""
    nonce = secrets.token_hex(8)
    opening, closing = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
    marked_msgs = [{**m, "content": _marked(m["content"], opening, closing)} for m in msgs]
    refusal = invalid_request(
        "The messages hold special-token text (e.g. '<|im_end|>'), which is kept as plain text, but this model's "
        "chat template transforms the content so that it cannot be located in the prompt. Remove the special-token "
        "text (or the server may set allow_special_tokens_in_content).", param="messages")
    try:
        marked = template.render(marked_msgs, add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError:
        raise refusal from None
    spans: list[tuple[int, int]] = []
    plain: list[str] = []
    length = 0
    inside = False
    for i, part in enumerate(re.split(f"({re.escape(opening)}|{re.escape(closing)})", marked)):
        if i % 2:  # a marker: they must alternate, opening first
            if (part == opening) == inside:
                raise refusal
            inside = part == opening
            if inside:
                start = length
            else:
                spans.append((start, length))
            continue
        plain.append(part)
        length += len(part)
    if inside or "".join(plain) != text:
        raise refusal
    return spans


def _texts(content: str | list[dict[str, str]]) -> list[str]:
    """The text of a template message's content (a string, or the text parts of a multimodal part list)."""
    return [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]


def _marked(content: str | list[dict[str, str]], opening: str, closing: str) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return opening + content + closing
    return [{**p, "text": opening + p["text"] + closing} if p["type"] == "text" else p for p in content]


def _with_added_special_tokens(tok: Tokenizer, ids: list[int]) -> list[int]:
    """`ids` with what the tokenizer's post-processor adds around a text (BOS), as `add_special_tokens` would."""
    probe = tok.encode("a", add_special_tokens=False)
    full = tok.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(probe) + 1):
        if full[i:i + len(probe)] == probe:
            return full[:i] + ids + full[i + len(probe):]
    return ids
