"""Tool calls in the server: the Hermes and Llama 3 JSON parsers (a stream split anywhere reads as the whole text),
the format the config or the chat template picks, the checks of tools / tool_choice (400s naming the field), the
grammar that forces calls (checked with xgrammar against the parser's own reading), and how tools and tool turns
reach a template that renders them and one that ignores them (the embedded SmolLM2's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from infer_protocol.config import load_config
from infer_protocol.messages import ModelInfo
from infer_server.chat_template import ChatTemplate
from infer_server.errors import ApiError
from infer_server.model_assets import ModelAssets, load_model_assets
from infer_server.openai_models import ChatCompletionRequest, ChatMessage
from infer_server.prompts import chat_prompt_ids
from infer_server.tool_calls import FORMATS, ParsedOutput, ToolCall, assemble, parse, resolve
from infer_server.tool_stream import ChoiceTools, tool_message
from infer_server.tools import ToolOutput, plan_tools

HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
NATIVE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
          "[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
          "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}"
          "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}")


# ------------------------------------------------------------------ parsers


def _streamed(fmt: Any, pieces: list[str]) -> ParsedOutput:
    reader = fmt.stream()
    events = [e for piece in pieces for e in reader.feed(piece)] + reader.finish()
    return assemble(events)


def test_hermes_reads_calls_and_the_text_around_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": ["}", {"a": 1}]}}'
            '\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "ping"}\n</tool_call>')
    assert parse(HERMES, text) == ParsedOutput("Let me check.", (
        ToolCall("get_weather", '{"city": "Paris", "x": ["}", {"a": 1}]}'), ToolCall("ping", "{}")))
    assert parse(HERMES, "no <tool_ call here") == ParsedOutput("no <tool_ call here", ())
    assert parse(HERMES, "<tool_call>not JSON</tool_call> then") == ParsedOutput("<tool_call>not JSON</tool_call> then",
                                                                                  ())
    cut = parse(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1')  # max_tokens cut it: what came is kept
    assert cut == ParsedOutput(None, (ToolCall("f", '{"a": 1'),))


def test_llama3_json_reads_a_turn_of_calls_or_content() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "ping", "parameters": {}}'
    assert parse(LLAMA, text) == ParsedOutput(None, (ToolCall("get_weather", '{"city": "Rome"}'),
                                                     ToolCall("ping", "{}")))
    assert parse(LLAMA, '{"answer": 42}') == ParsedOutput('{"answer": 42}', ())
    assert parse(LLAMA, 'Hi {"name": "f", "parameters": {}}') == ParsedOutput('Hi {"name": "f", "parameters": {}}', ())


_json = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | st.text("ab{}[]\",:\\ é", max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("xy\"}", max_size=3), inner,
                                                                                  max_size=3), max_leaves=8)
_calls = st.lists(st.tuples(st.sampled_from(["f", "get_weather", "a-b_1"]),
                            st.dictionaries(st.text("kv\"{", min_size=1, max_size=3), _json, max_size=3)),
                  min_size=0, max_size=3)


@settings(max_examples=150, deadline=None)
@given(calls=_calls, before=st.sampled_from(["", "Sure. ", "a < b <tool", " \n"]), data=st.data())
def test_hermes_stream_split_anywhere_reads_as_the_whole_text(calls: list, before: str, data: st.DataObject) -> None:
    text = before + "\n".join(HERMES.render_calls([{"name": n, "arguments": a}]) for n, a in calls)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = parse(HERMES, text)
    assert _streamed(HERMES, pieces) == whole
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert whole.content == (before.strip() or None)


@settings(max_examples=100, deadline=None)
@given(calls=_calls.filter(bool), tag=st.booleans(), data=st.data())
def test_llama3_stream_split_anywhere_reads_as_the_whole_text(calls: list, tag: bool, data: st.DataObject) -> None:
    text = ("<|python_tag|>" if tag else "") + LLAMA.render_calls([{"name": n, "arguments": a} for n, a in calls])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = parse(LLAMA, text)
    assert _streamed(LLAMA, pieces) == whole and whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls


def test_stream_deltas_have_openai_shape_and_parallel_false_keeps_one_call() -> None:
    text = HERMES.render_calls([{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "arguments": {}}])
    reader = ChoiceTools(ToolOutput(HERMES, parallel=False))
    deltas = [d for ch in text for d in reader.feed(ch)] + reader.finish()
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["function"] == {"name": "f",
                                                                                            "arguments": ""}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 3 and json.loads("".join(fragments)) == {"a": [1, 2]} and reader.calls == 1
    message = tool_message(parse(HERMES, text), ToolOutput(HERMES, parallel=False))
    assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == ["f"]


# ------------------------------------------------------------------ the format and the checks


def test_the_format_comes_from_the_config_or_the_template_text(embedded_model_dir: Path) -> None:
    smol = ChatTemplate.from_model_dir(embedded_model_dir)
    assert resolve("auto", smol.source if smol else None) is HERMES
    assert resolve("auto", "{{ '<|python_tag|>' }}") is LLAMA and resolve("auto", "{% if role == 'ipython' %}") is LLAMA
    assert resolve("llama3_json", smol.source if smol else None) is LLAMA and resolve("none", None) is None


def _req(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields,param,message", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0].type' must be 'function'"),
    ({"tools": [{"type": "function"}]}, "tools", "'tools[0].function'"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "function.name' must match"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 3, "maximum": 1}}}}}]}, "tools", "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "as an object must be"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tool_choice": "none"}, "tool_choice", "only allowed when 'tools'"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", "only allowed when 'tools'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot follow"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {"enum": ["x" * 1000]}}}
                for i in range(70)], "tool_choice": "required"}, "tools", "at most"),
])
def test_bad_tools_are_400_naming_the_field(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(ApiError) as info:
        plan_tools(_req(**fields), "auto", None)
    assert info.value.status == 400 and info.value.param == param and message in info.value.message


def test_tools_with_the_parser_off_are_refused() -> None:
    with pytest.raises(ApiError, match="tool_call_parser") as info:
        plan_tools(_req(tools=TOOLS), "none", None)
    assert info.value.code == "unsupported_parameter"


def test_auto_and_none_force_nothing() -> None:
    auto = plan_tools(_req(tools=TOOLS), "auto", None)
    assert auto.grammar is None and auto.output == ToolOutput(HERMES, True) and len(auto.rendering.tools) == 2
    none = plan_tools(_req(tools=TOOLS, tool_choice="none"), "auto", None)
    assert none.output is None and none.grammar is None and none.rendering.tools == ()


@pytest.fixture(scope="module")
def compiler(embedded_model_dir: Path) -> Any:
    xgr = pytest.importorskip("xgrammar")
    from infer_worker.infrastructure.grammar_tokenizer import tokenizer_info_factory

    return xgr.GrammarCompiler(tokenizer_info_factory(embedded_model_dir)(49152), max_threads=1)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_the_forcing_grammar_takes_exactly_the_calls_the_parser_reads(compiler: Any, embedded_model_dir: Path,
                                                                      fmt: str, choice: Any, parallel: bool) -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    plan = plan_tools(_req(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel), fmt, None)
    assert plan.grammar is not None and plan.grammar.param == "tool_choice"
    compiled = compiler.compile_structural_tag(plan.grammar.spec.schema)

    def takes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[tok.eos_token_id])  # as the worker's
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
            matcher.accept_token(tok.eos_token_id)

    good = [{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]
    two = [*good, {"name": "ping", "arguments": {}}]
    text = FORMATS[fmt].render_calls(good)
    assert takes(text) and parse(FORMATS[fmt], text).calls == (ToolCall("get_weather", '{"city": "Rome", "days": 3}'),)
    assert takes(FORMATS[fmt].render_calls(two)) == (parallel and choice == "required")
    assert not takes(FORMATS[fmt].render_calls([{"name": "get_weather", "arguments": {"city": "Rome", "days": 9}}]))
    assert not takes("Sure! " + text) and not takes("")


# ------------------------------------------------------------------ rendering


@pytest.fixture(scope="module")
def smol_assets(embedded_model_dir: Path) -> ModelAssets:
    info = ModelInfo(model_dir=str(embedded_model_dir), max_model_len=8192, vocab_size=49152, backend="fake",
                     device="cpu", dtype="float32")
    return load_model_assets(info, load_config(environ={}))


HISTORY = [ChatMessage(role="user", content="Weather in Rome?"),
           ChatMessage(role="assistant", content=None, tool_calls=[{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]),
           ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]


def test_a_template_that_ignores_tools_gets_them_in_the_formats_words(smol_assets: ModelAssets) -> None:
    plan = plan_tools(_req(tools=TOOLS), "auto", smol_assets.chat_template)
    assert not plan.rendering.native_tools and not plan.rendering.native_calls
    text = smol_assets.tokenizer.decode(chat_prompt_ids(smol_assets, HISTORY, True, plan.rendering),
                                        skip_special_tokens=False)
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in listed
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n'
            '</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


def test_a_template_that_renders_tools_gets_them_as_hf_passes_them() -> None:
    template = ChatTemplate(NATIVE)
    plan = plan_tools(_req(tools=TOOLS), "auto", template)
    assert plan.rendering.native_tools and plan.rendering.native_calls
    from infer_server.params import template_messages
    from infer_server.tools import tool_turn

    msgs = [tool_turn(m, i, item, plan.rendering) for i, (m, item) in enumerate(zip(HISTORY,
                                                                                    template_messages(HISTORY)))]
    text = template.render(msgs, tools=list(plan.rendering.tools))
    assert text == ('<user>Weather in Rome?<assistant>[call get_weather {"city": "Rome", "days": 1}]'
                    "<tool>sunny(for call_1)TOOLS:get_weather;ping;")


@pytest.mark.parametrize("message,problem", [
    (ChatMessage(role="tool", content="x"), "tool_call_id"),
    (ChatMessage(role="user", content="x", tool_calls=[{"type": "function", "function": {"name": "f"}}]),
     "belongs to an 'assistant'"),
    (ChatMessage(role="assistant", tool_calls=[{"type": "function", "function": {"name": "f", "arguments": {}}}]),
     "string 'name' and 'arguments'"),
])
def test_broken_tool_turns_are_400(smol_assets: ModelAssets, message: ChatMessage, problem: str) -> None:
    with pytest.raises(ApiError, match=problem):
        chat_prompt_ids(smol_assets, [ChatMessage(role="user", content="hi"), message], True)
