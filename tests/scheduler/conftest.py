"""Helpers shared by the scheduler tests."""

from __future__ import annotations

import itertools

from infer_protocol.messages import SamplingParams, Submit
from infer_scheduler.engine import Engine

_ids = itertools.count(1)


def make_submit(prompt: list[int], max_tokens: int = 4, rid: str | None = None, **kw) -> Submit:
    return Submit(request_id=rid or f"r{next(_ids)}", prompt_token_ids=list(prompt),
                  sampling=SamplingParams(temperature=0.0, logprobs=kw.pop("logprobs", False)), max_tokens=max_tokens,
                  **kw)


def make_engine(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256, **kw) -> Engine:
    return Engine(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len, **kw)
