"""The OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
from dataclasses import replace

import msgspec
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from infer_protocol.messages import ImageInput

from infer_server.errors import ApiError, not_ready, require_json_content_type
from infer_server.image_parts import collect_image_parts, load_images, place_images
from infer_server.model_assets import served_model_name
from infer_server.openai_models import ChatCompletionRequest, CompletionRequest
from infer_server.params import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    build_params,
    check_chat_request,
    check_completion_request,
    check_model,
    completion_prompts,
    echo_texts,
    usage_reporting,
)
from infer_server.prompts import chat_prompt_ids, messages_size, off_loop
from infer_server.serving import serve_generation
from infer_server.state import server_state
from infer_server.tools import plan_tools

router = APIRouter(dependencies=[Depends(require_json_content_type)], strict_content_type=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    assets = state.require_assets()
    check_model(body.model, assets)
    check_chat_request(body)
    tools = plan_tools(body, state.config.tool_call_parser, assets.chat_template)
    vision = assets.vision
    parts = collect_image_parts(body.messages, vision, state.config, no_vision=assets.no_vision)
    images = await load_images(parts, vision, state.config) if parts and vision is not None else []
    prompt_ids = await off_loop(messages_size(body.messages), chat_prompt_ids, assets, body.messages,
                                body.add_generation_prompt, tools.rendering,
                                literal_content=not state.config.allow_special_tokens_in_content,
                                images=vision is not None)
    image_inputs: list[ImageInput] = []
    if vision is not None:
        prompt_ids, image_inputs = place_images(prompt_ids, images, vision)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_params(body, prompt_ids, max_tokens, assets, state.config, what="messages", param="messages",
                          logprobs=logprobs, grammar=tools.grammar)
    if image_inputs:
        params = [replace(p, images=tuple(image_inputs)) for p in params]
    return await serve_generation(state, request, kind="chat", params=params, model=assets.served_name,
                                  stream=body.stream, prompt_tokens=len(prompt_ids),
                                  usage_reporting=usage_reporting(body.stream_options),
                                  return_token_ids=body.return_token_ids, logprobs=logprobs is not None,
                                  tools=tools.output)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    assets = state.require_assets()
    check_model(body.model, assets)
    check_completion_request(body)
    size = len(body.prompt) if isinstance(body.prompt, str) else sum(len(p) for p in body.prompt
                                                                     if isinstance(p, str | list))
    prompts = await off_loop(size, completion_prompts, body, assets)
    echo_logprobs = bool(body.echo) and body.logprobs is not None
    params = [p for ids in prompts for p in build_params(body, ids, body.max_tokens, assets, state.config,
                                                         what="prompt", param="prompt", logprobs=body.logprobs,
                                                         prompt_logprobs=echo_logprobs,
                                                         default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)]
    return await serve_generation(state, request, kind="completion", params=params, model=assets.served_name,
                                  stream=body.stream, prompt_tokens=sum(len(ids) for ids in prompts),
                                  usage_reporting=usage_reporting(body.stream_options),
                                  return_token_ids=body.return_token_ids, logprobs=body.logprobs is not None,
                                  echo=echo_texts(body, assets, prompts))


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = server_state(request)
    assets = state.loader.assets
    info = assets.info if assets is not None else state.client.model_info
    if assets is not None:
        name: str | None = assets.served_name
    else:
        name = served_model_name(state.config, info.model_dir if info else None)
    if name is None:
        raise not_ready(state.readiness_detail())
    max_model_len = info.max_model_len if info is not None else (state.config.max_model_len or None)
    card = {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "rustinfer",
        "root": info.model_dir if info is not None else (state.config.model or None),
        "parent": None,
        "max_model_len": max_model_len,
    }
    return Response(msgspec.json.encode({"object": "list", "data": [card]}), media_type="application/json")


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    listing = msgspec.json.decode((await list_models(request)).body)
    for card in listing["data"]:
        if card["id"] == model_id:
            return Response(msgspec.json.encode(card), media_type="application/json")
    raise ApiError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
