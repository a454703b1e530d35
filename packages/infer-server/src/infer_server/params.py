"""From a validated OpenAI request to what the scheduler gets: prompt ids, sampling, limits, stops.

Everything a request asks for is either honoured or refused here with a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from infer_protocol.config import Config
from infer_protocol.messages import ImageInput, SamplingParams, StructuredOutput, Submit

from infer_server.errors import ApiError, invalid_request, model_not_found, unsupported
from infer_server.model_assets import ModelAssets
from infer_server.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationFields,
    ResponseFormat,
    StreamOptions,
    StructuredOutputsParams,
)
from infer_server.openai_responses import UsageReporting

_SEED_MOD = 2**63  # seeds travel as non-negative int64
# Each entry costs every step of the request a scatter over its logits row; far more than anyone biases by hand.
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0
# Every stop string is matched against every streamed delta on the server's event loop, shared by all requests.
MAX_STOP_STRINGS = 64
# Choices of one completion request (prompts x n): each is a sequence in the scheduler, admitted at once.
MAX_CHOICES = 128
# OpenAI's (and vLLM's) `max_tokens` of /v1/completions when omitted; chat's is the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """One sequence to generate (a request with n > 1 makes n of these)."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    stop: tuple[str, ...]
    include_stop: bool
    skip_special_tokens: bool
    first_choice: bool = True  # the first of its prompt's n choices (the one its usage's cached tokens come from)
    score_only: bool = False  # completions' max_tokens 0 with echo: one token is generated, none is shown
    images: tuple[ImageInput, ...] = ()  # the prompt's images (their placeholders are in prompt_token_ids)
    grammar_param: str | None = None  # the request field the grammar came from: its compile errors name it

    def submit(self, request_id: str) -> Submit:
        return Submit(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            max_tokens=self.max_tokens,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            images=list(self.images),
        )


# ------------------------------------------------------------------ checks


def check_model(requested: str | None, assets: ModelAssets) -> None:
    if requested is not None and requested != "" and requested not in assets.aliases:
        raise model_not_found(requested)


def _check_common(req: GenerationFields) -> None:
    if req.stream_options is not None:
        if not req.stream:
            raise invalid_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if req.return_token_ids and req.stream:
        raise unsupported("return_token_ids", "only without 'stream'")


def check_chat_request(req: ChatCompletionRequest) -> None:
    _check_common(req)
    if req.top_logprobs and not req.logprobs:
        raise invalid_request("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    if req.functions:
        raise unsupported("functions")
    if req.function_call not in (None, "none"):
        raise unsupported("function_call")


def check_completion_request(req: CompletionRequest) -> None:
    _check_common(req)
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of", "only best_of equal to n is accepted")
    if req.suffix:
        raise unsupported("suffix")


def usage_reporting(options: StreamOptions | None) -> UsageReporting:
    if options is None or not options.include_usage:
        return UsageReporting.NONE  # continuous_usage_stats alone reports nothing (vLLM: it refines include_usage)
    return UsageReporting.CONTINUOUS if options.continuous_usage_stats else UsageReporting.FINAL


# ------------------------------------------------------------------ prompts


def _message_content(message: ChatMessage, index: int, images: bool) -> str | list[dict[str, str]]:
    """The content the template gets: a string (text parts joined with newlines), or, when the message holds an
    image and `images` allows them, the parts as HF's multimodal templates take them: `{"type": "image"}` (the
    template writes the image's placeholder) and `{"type": "text", "text": ...}`."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        if part.type == "image_url" and images:
            parts.append({"type": "image"})
            continue
        if part.type != "text":
            raise unsupported(f"messages[{index}].content[{j}]", f"content part type '{part.type}' (only 'text')")
        if part.text is None:
            raise invalid_request(f"Missing required parameter: 'messages[{index}].content[{j}].text' (a text part "
                                  "needs its text).", param="messages", code="missing_required_parameter")
        parts.append({"type": "text", "text": part.text})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def template_messages(messages: Sequence[ChatMessage], *, images: bool = False) -> list[dict[str, Any]]:
    """Chat messages as the dicts a HF chat template expects (content a string, or with `images` a list of parts
    for a message that holds an image); their tool calls and tool results are added by
    `infer_server.tools.tool_turn`."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for it
        item: dict[str, Any] = {"role": role, "content": _message_content(message, i, images)}
        if message.name is not None:
            item["name"] = message.name
        out.append(item)
    return out


def completion_prompts(req: CompletionRequest, assets: ModelAssets) -> list[list[int]]:
    """The token ids of each prompt of a completion request: a string, a list of strings, a list of token ids
    (one prompt) or a list of token-id lists (one prompt each). Its special-token text is parsed (the prompt is the
    caller's raw text, as in vLLM). Blocking for a long prompt: run it off the event loop."""
    prompt = req.prompt
    if isinstance(prompt, str):
        check_text_fits(prompt, assets, what="prompt", param="prompt")
        return [assets.tokenizer.encode(prompt, add_special_tokens=True)]
    if not prompt:
        raise invalid_request("'prompt' must not be empty", param="prompt")
    if _is_int(prompt[0]):
        prompts = [[int(t) for t in prompt]]  # type: ignore[arg-type]
    else:
        if len(prompt) * req.n > MAX_CHOICES:
            raise invalid_request(f"{len(prompt)} prompts x n={req.n} make {len(prompt) * req.n} choices; at most "
                                  f"{MAX_CHOICES} are served in one request", param="prompt")
        for p in prompt:
            if isinstance(p, str):
                check_text_fits(p, assets, what="prompt", param="prompt")
        prompts = [assets.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
                   for p in prompt]  # type: ignore[union-attr]
    for ids in prompts:
        check_token_ids(ids, assets, "prompt")
    return prompts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def echo_texts(req: CompletionRequest, assets: ModelAssets, prompts: list[list[int]]) -> list[str] | None:
    """The prompt text `echo` prepends to each choice (None without echo), prompt-major like the choices: the
    prompt string as sent, or the decoded token ids for a token prompt."""
    if not req.echo:
        return None
    prompt = req.prompt
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt[0], str):
        texts = [str(p) for p in prompt]
    else:
        texts = [assets.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in prompts]
    return [text for text in texts for _ in range(req.n)]


def check_token_ids(ids: Sequence[int], assets: ModelAssets, param: str) -> None:
    vocab = assets.vocab_size
    for t in ids:
        if t < 0 or (vocab > 0 and t >= vocab):
            raise invalid_request(f"'{param}' holds token id {t}, outside the vocabulary [0, {vocab})", param=param)


# ------------------------------------------------------------------ response_format

# The worker compiles every distinct schema (and keeps it cached): a bound on what one request can make it do.
MAX_SCHEMA_CHARS = 64 * 1024
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Keywords whose value is a schema, a list of schemas, or an object of schemas (checked recursively).
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "unevaluatedProperties",
              "unevaluatedItems", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def _param_of(where: str) -> str:
    """The request field a path like `tools[0].function.parameters.type` lies in."""
    return re.split(r"[.\[]", where, maxsplit=1)[0]


def check_schema(schema: Any, where: str) -> None:
    """The structural rules of JSON Schema that a grammar needs (the worker's grammar engine refuses what it cannot
    compile with a 400 of its own): a 400 naming the first broken keyword by its path."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid_request(f"{where} must be a JSON Schema (an object or a boolean)", param=_param_of(where))
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not isinstance(kind, (str, list, type(None))) or any(k not in _JSON_TYPES for k in kinds):
        raise invalid_request(f"{where}.type must be one of {sorted(_JSON_TYPES)} (or a list of them)",
                              param=_param_of(where))
    for key in _SUBSCHEMA:
        if key in schema:
            check_schema(schema[key], f"{where}.{key}")
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise invalid_request(f"{where}.{key} must be a non-empty array of schemas", param=_param_of(where))
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}.{key}[{i}]")
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise invalid_request(f"{where}.{key} must be an object of schemas", param=_param_of(where))
            for name, sub in schema[key].items():
                check_schema(sub, f"{where}.{key}.{name}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise invalid_request(f"{where}.required must be an array of strings", param=_param_of(where))
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise invalid_request(f"{where}.enum must be a non-empty array", param=_param_of(where))
    for key in _COUNTS:
        value = schema.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise invalid_request(f"{where}.{key} must be a non-negative integer", param=_param_of(where))
    for low, high in (("minItems", "maxItems"), ("minLength", "maxLength"), ("minimum", "maximum"),
                      ("minProperties", "maxProperties")):
        lo, hi = schema.get(low), schema.get(high)
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
            raise invalid_request(f"{where}: {low} ({lo}) exceeds {high} ({hi}), so nothing matches",
                                  param=_param_of(where))
    if "$ref" in schema and not isinstance(schema["$ref"], str):
        raise invalid_request(f"{where}.$ref must be a string", param=_param_of(where))


def _canonical(schema: Any, where: str) -> str:
    """A checked schema as the canonical JSON text the worker compiles (and caches by)."""
    check_schema(schema, where)
    return bounded(json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False), where)


def bounded(text: str, where: str) -> str:
    """A grammar's text, or a 400 when it is too large to compile for one request."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise invalid_request(f"'{where}' is {len(text)} characters; at most {MAX_SCHEMA_CHARS} are accepted",
                              param=_param_of(where))
    return text


def check_grammar_fields(req: GenerationFields, param: str) -> None:
    """The grammar ends the output by allowing only the stop tokens (EOS): it needs them, unmasked. Nothing else may
    end the output before the grammar does (a stop string), nor mask the tokens it needs (allowed_token_ids).
    `stop_token_ids` are the grammar's own stop tokens (refused like EOS until the output is complete): kept."""
    if req.ignore_eos:
        raise unsupported("ignore_eos", f"not with '{param}' (the output ends on EOS once it is complete)")
    if req.min_tokens:
        raise unsupported("min_tokens", f"not with '{param}'")
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(stops):  # ("" never matches: the stop-string matcher drops it)
        raise invalid_request(f"'stop' cannot be combined with '{param}': a stop string could cut the structured "
                              f"output mid-document (the grammar ends the output itself once it is complete)",
                              param="stop", code="unsupported_parameter")
    if req.allowed_token_ids is not None:
        raise invalid_request(f"'allowed_token_ids' cannot be combined with '{param}': the grammar's next tokens "
                              f"and these could have nothing in common, leaving no token to sample",
                              param="allowed_token_ids", code="unsupported_parameter")


def structured_output(fmt: ResponseFormat | None, req: GenerationFields) -> StructuredOutput | None:
    """The grammar `response_format` asks for (None for text), or a 400 naming what is wrong with it."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise invalid_request("'response_format.json_schema' needs type 'json_schema'", param="response_format")
        return None
    check_grammar_fields(req, "response_format")
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise invalid_request("'response_format.json_schema' needs type 'json_schema'", param="response_format")
        return StructuredOutput(kind="json_object")
    if fmt.json_schema is None:
        raise invalid_request("Missing required parameter: 'response_format.json_schema'", param="response_format",
                              code="missing_required_parameter")
    schema = fmt.json_schema.schema_
    if schema is None:  # OpenAI's schema is optional: without one, any JSON object
        return StructuredOutput(kind="json_object")
    return StructuredOutput(kind="json_schema", schema=_canonical(schema, "response_format.json_schema.schema"))


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose sentences are exactly the choices: JSON string literals are xgrammar's string literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def structured_outputs_grammar(so: StructuredOutputsParams | None,
                               req: GenerationFields) -> StructuredOutput | None:
    """vLLM's `structured_outputs`: the one constraint it names, or a 400."""
    if so is None:
        return None
    given = [name for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                      ("grammar", so.grammar), ("json_object", so.json_object or None))
             if value is not None]
    if len(given) != 1:
        raise invalid_request(f"'structured_outputs' must set exactly one of json, regex, choice, grammar, "
                              f"json_object (it sets {given or 'none'})", param="structured_outputs")
    check_grammar_fields(req, "structured_outputs")
    where = f"structured_outputs.{given[0]}"
    if so.json_ is not None:
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise invalid_request(f"'{where}' is not JSON: {exc}", param="structured_outputs") from None
        return StructuredOutput(kind="json_schema", schema=_canonical(schema, where))
    if so.regex is not None:
        if not so.regex:
            raise invalid_request(f"'{where}' must not be empty", param="structured_outputs")
        return StructuredOutput(kind="regex", schema=bounded(so.regex, where))
    if so.choice is not None:
        if not so.choice:
            raise invalid_request(f"'{where}' must not be empty", param="structured_outputs")
        return StructuredOutput(kind="grammar", schema=bounded(choice_grammar(so.choice), where))
    if so.grammar is not None:
        if not so.grammar.strip():
            raise invalid_request(f"'{where}' must not be empty", param="structured_outputs")
        return StructuredOutput(kind="grammar", schema=bounded(so.grammar, where))
    return StructuredOutput(kind="json_object")


class RequestGrammar(NamedTuple):
    """The grammar a request's output follows and the request field it came from (named by its errors)."""

    spec: StructuredOutput
    param: str


def request_grammar(req: GenerationFields) -> RequestGrammar | None:
    """response_format or structured_outputs (not both): what the output must follow."""
    fmt = structured_output(req.response_format, req)
    so = structured_outputs_grammar(req.structured_outputs, req)
    if fmt is not None and so is not None:
        raise invalid_request("'response_format' and 'structured_outputs' cannot both constrain the output",
                              param="structured_outputs")
    if fmt is not None:
        return RequestGrammar(fmt, "response_format")
    return RequestGrammar(so, "structured_outputs") if so is not None else None


# ------------------------------------------------------------------ limits and sampling


def resolve_logit_bias(bias: dict[str, float] | None, assets: ModelAssets) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token id as a decimal string -> bias in [-100, 100]) as (id, bias) pairs, ids
    ascending; a key that is not a token id of the vocabulary or a value out of range is a 400."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid_request(f"'logit_bias' holds {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are accepted",
                              param="logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and str(int(key)) == key):
            raise invalid_request(f"'logit_bias' key {key!r} is not a token id (a decimal integer)", param="logit_bias")
        if not (math.isfinite(value) and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
            raise invalid_request(f"'logit_bias' value {value} for token {key} is outside [-100, 100]",
                                  param="logit_bias")
        pairs.append((int(key), float(value)))
    check_token_ids([token for token, _ in pairs], assets, "logit_bias")
    return tuple(sorted(pairs))


def context_error(limit: int, prompt_len: int, max_tokens: int | None, what: str, param: str) -> ApiError:
    completion = "at least 1" if max_tokens is None else str(max_tokens)
    requested = prompt_len + (1 if max_tokens is None else max_tokens)
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested {requested} tokens "
        f"({prompt_len} in the {what}, {completion} in the completion). "
        f"Please reduce the length of the {what} or completion.",
        param=param,
        code="context_length_exceeded",
    )


def check_text_fits(text: str, assets: ModelAssets, *, what: str, param: str) -> None:
    """400 context_length_exceeded, before tokenizing, for a text that is certain to exceed the context."""
    per_token = assets.tokenizer.max_token_chars
    limit = assets.max_model_len
    if per_token is None or limit <= 0 or len(text) <= per_token * limit:
        return
    at_least = math.ceil(len(text) / per_token)
    raise ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, the {what} ({len(text)} characters) is at "
        f"least {at_least} tokens. Please reduce the length of the {what}.",
        param=param,
        code="context_length_exceeded",
    )


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, limit: int, *, what: str, param: str,
                       default: int | None = None) -> int:
    """max_tokens after the context check. Omitted: `default` (completions' 16), cut to the rest of the context as
    vLLM does, or without a default the rest of the context (chat)."""
    if prompt_len == 0:
        raise invalid_request(f"the {what} is empty (0 tokens)", param=param)
    if limit > 0:
        if prompt_len >= limit and (max_tokens is None or prompt_len > limit):
            raise context_error(limit, prompt_len, max_tokens, what, param)
        if max_tokens is None:
            return limit - prompt_len if default is None else min(default, limit - prompt_len)
        if prompt_len + max_tokens > limit:
            raise context_error(limit, prompt_len, max_tokens, what, "max_tokens")
    if max_tokens is None:
        if default is not None:
            return default
        raise invalid_request("'max_tokens' is required: the model's context length is unknown", param="max_tokens")
    return max_tokens


def _requested_or_default(req: GenerationFields, assets: ModelAssets, name: str, openai_default: float) -> float:
    """The request's own value of a sampling field, else the model's (generation_config.json), else OpenAI's."""
    value = getattr(req, name)
    return float(value) if value is not None else assets.sampling_defaults.get(name, openai_default)


def build_params(
    req: GenerationFields,
    prompt_ids: list[int],
    max_tokens: int | None,
    assets: ModelAssets,
    config: Config,
    *,
    what: str,
    param: str,
    logprobs: int | None = None,
    prompt_logprobs: bool = False,
    default_max_tokens: int | None = None,
    grammar: RequestGrammar | None = None,
) -> list[GenerationParams]:
    """One GenerationParams per choice (n), or a 400 naming the offending field. `logprobs`: None = no
    logprobs, k = the sampled token's logprob and the k most likely alternatives per token; `prompt_logprobs`: the
    same for the prompt tokens (completions' echo with logprobs); `grammar`: what the output follows (default: the
    request's response_format / structured_outputs)."""
    limit = assets.max_model_len
    score_only = max_tokens == 0
    if score_only and not prompt_logprobs:
        raise invalid_request("'max_tokens' 0 scores the prompt: it needs 'echo' and 'logprobs'", param="max_tokens")
    resolved = resolve_max_tokens(len(prompt_ids), 1 if score_only else max_tokens, limit, what=what, param=param,
                                  default=default_max_tokens)
    if req.min_tokens > resolved:
        raise invalid_request(f"'min_tokens' ({req.min_tokens}) exceeds max_tokens ({resolved})", param="min_tokens")
    client_stop_ids = list(req.stop_token_ids or [])
    check_token_ids(client_stop_ids, assets, "stop_token_ids")
    ignore_eos = req.ignore_eos or config.ignore_eos
    stop_ids = list(client_stop_ids)
    if not ignore_eos:
        stop_ids += [e for e in assets.eos_token_ids if e not in client_stop_ids]
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid_request(f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted",
                              param="stop")
    logit_bias = resolve_logit_bias(req.logit_bias, assets)
    allowed = tuple(sorted(set(req.allowed_token_ids or ())))
    if req.allowed_token_ids is not None and not allowed:
        raise invalid_request("'allowed_token_ids' must not be empty", param="allowed_token_ids")
    check_token_ids(allowed, assets, "allowed_token_ids")
    if allowed and req.min_tokens > 0 and set(allowed) <= set(stop_ids):
        raise invalid_request("'allowed_token_ids' holds only stop tokens, which 'min_tokens' masks: nothing is left "
                              "to sample", param="allowed_token_ids")
    temperature = _requested_or_default(req, assets, "temperature", 1.0)
    top_p = _requested_or_default(req, assets, "top_p", 1.0)
    min_p = _requested_or_default(req, assets, "min_p", 0.0)
    repetition_penalty = _requested_or_default(req, assets, "repetition_penalty", 1.0)
    if grammar is None:
        grammar = request_grammar(req)
    top_k = int(_requested_or_default(req, assets, "top_k", 0))
    top_k = top_k if top_k > 0 else 0  # -1 and 0 are off
    if top_k >= (assets.vocab_size or 2**31):
        top_k = 0  # keeps every token, like off (and a huge k would not fit the engine's int32)
    out = []
    for i in range(req.n):
        seed = random.getrandbits(63) if req.seed is None else (req.seed + i) % _SEED_MOD
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=repetition_penalty,
            min_tokens=req.min_tokens,
            logit_bias=logit_bias,
            allowed_token_ids=allowed,
            prompt_logprobs=prompt_logprobs,
            structured=grammar.spec if grammar is not None else None,
        )
        out.append(
            GenerationParams(
                prompt_token_ids=prompt_ids,
                sampling=sampling,
                max_tokens=resolved,
                stop_token_ids=stop_ids,
                ignore_eos=ignore_eos,
                min_tokens=req.min_tokens,
                stop=stop,
                include_stop=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                first_choice=i == 0,
                score_only=score_only,
                grammar_param=grammar.param if grammar is not None else None,
            )
        )
    return out
