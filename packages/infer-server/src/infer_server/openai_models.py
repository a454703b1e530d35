"""Pydantic request models for the OpenAI schema (and the /tokenize, /detokenize extensions).

Unknown fields are refused (`extra="forbid"`): a field the server does not know must not be ignored
silently. Types are strict (`strict=True`): `"5"`, `true` or `5.0` is not an integer, `"yes"` not a boolean,
`[true, false]` not a token prompt; only an integer still passes for a float (`"temperature": 1`), as in JSON.
Fields the server knows but does not implement are declared so that their neutral values pass; `params.py` refuses
anything else with a 400 naming the field. Type and range checks live here, so they show up in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs (and vLLM's default max_logprobs)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ImageUrl(_Strict):
    """OpenAI's `image_url` of a content part: a data URL (or, where the server allows it, an http(s) URL).
    `detail` is accepted and has no effect: the model's image processor decides the resolution."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(BaseModel):
    """One part of a list-form message content: `{"type": "text", "text": ...}`, or `{"type": "image_url",
    "image_url": {"url": ...}}` for a model with a vision tower."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`; `strict` is accepted either way (outputs always follow the schema)."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema (see params.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of its constraints (checked in params.py)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON Schema (or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF), root rule `root`
    json_object: bool | None = None


class GenerationFields(_Strict):
    """Fields shared by both generation endpoints."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # vLLM's extension: the matched stop string ends the text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=128)
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's extension: each choice carries its generated token ids
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # OpenAI, over generated tokens
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # OpenAI, over generated tokens
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # HF/vLLM, over prompt + generated tokens
    # OpenAI: token id (a decimal string) -> bias in [-100, 100] added to its logit (checked in params.py)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's extension: sample only among these tokens
    response_format: ResponseFormat | None = None  # OpenAI (chat); vLLM also takes it on completions
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's extension: regex, choice, grammar, json


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # known, not implemented
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt only (with echo and logprobs)
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # known, not implemented
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False
