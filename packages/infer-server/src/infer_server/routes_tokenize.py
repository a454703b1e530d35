"""/tokenize and /detokenize (the vLLM extensions): the served model's tokenizer and chat template."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from infer_server.errors import invalid_request, require_json_content_type
from infer_server.openai_models import DetokenizeRequest, TokenizeRequest
from infer_server.params import check_model, check_token_ids
from infer_server.prompts import chat_prompt_ids, messages_size, off_loop
from infer_server.state import server_state
from infer_server.tools import history_rendering

router = APIRouter(dependencies=[Depends(require_json_content_type)], strict_content_type=False)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state = server_state(request)
    assets = state.require_assets(scheduler=False)
    check_model(body.model, assets)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("exactly one of 'prompt' and 'messages' is required", param="prompt")
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await off_loop(len(body.prompt), assets.tokenizer.encode, body.prompt, add_special_tokens=add_special)
    else:
        assert body.messages is not None
        ids = await off_loop(messages_size(body.messages), chat_prompt_ids, assets, body.messages,
                             body.add_generation_prompt,
                             history_rendering(state.config.tool_call_parser, assets.chat_template),
                             add_special_tokens=bool(body.add_special_tokens),
                             literal_content=not state.config.allow_special_tokens_in_content, check_fits=False)
    out = {"count": len(ids), "max_model_len": assets.max_model_len, "tokens": ids}
    return Response(msgspec.json.encode(out), media_type="application/json")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = server_state(request)
    assets = state.require_assets(scheduler=False)
    check_model(body.model, assets)
    check_token_ids(body.tokens, assets, "tokens")
    text = assets.tokenizer.decode(body.tokens, skip_special_tokens=body.skip_special_tokens)
    return Response(msgspec.json.encode({"prompt": text}), media_type="application/json")
