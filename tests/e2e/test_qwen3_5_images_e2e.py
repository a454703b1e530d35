"""Images in chat, end to end: the three real processes on the CPU backend serving a tiny random Qwen3.5 with its
vision tower (the published layout, written by transformers) and a tokenizer holding the vision tokens. An
image_url data-URL chat request's greedy tokens equal transformers' generate on the prompt its own tokenizer and
template make (the image's placeholders expanded as the processor does), next to a text request and a two-image
one; streamed equals unstreamed; usage.prompt_tokens counts the image tokens."""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import ServedCluster
from tests.e2e.sse import stream_events

MODEL = "tiny-qwen3.5-vl"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedCluster, Any, Path]]:
    from tests.server.test_images import write_vision_model_dir
    from tests.worker.qwen3_5_checkpoints import qwen3_5_vl_config, random_qwen3_5

    model_dir = write_vision_model_dir(tmp_path_factory.mktemp("qwen3_5-vl-e2e") / "model")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]  # the tokenizer's
    added = {t["content"]: t["id"] for t in json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]}
    config = qwen3_5_vl_config(added["<|image_pad|>"], added["<|vision_start|>"], added["<|vision_end|>"],
                               vocab_size=vocab)
    hf = random_qwen3_5(config, seed=9)
    generation = (model_dir / "generation_config.json").read_text()
    hf.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / "generation_config.json").write_text(generation)  # (the tokenizer's stop token, not none)
    # chunks of 16 prompt tokens: the image prompts span several prefill chunks
    cluster = ServedCluster(tmp_path_factory.mktemp("qwen3_5-vl-cluster"), model=str(model_dir), model_name=MODEL,
                            block_size=16, chunked_prefill_size=16, max_batch_tokens=32, max_batch_seqs=4,
                            max_model_len=128, idle_prefill_uses_step_budget=False)
    cluster.start()
    try:
        yield cluster, hf, model_dir
    finally:
        cluster.stop()


def png(width: int, height: int, seed: int) -> bytes:
    from tests.server.test_images import image_bytes
    return image_bytes(width, height, "PNG", seed=seed)


def messages(question: str, *images: bytes) -> list[dict[str, Any]]:
    from tests.server.test_images import data_url, image_part
    return [{"role": "user", "content": [*(image_part(data_url(im)) for im in images),
                                         {"type": "text", "text": question}]}]


def expected(hf: Any, model_dir: Path, question: str, *images: bytes) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) by transformers: its tokenizer and the model's template, each image's placeholder
    expanded to the image's tokens (as the Qwen3-VL processor does), generate with the processor's pixels."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.server.test_images import PREPROCESSOR

    tok = AutoTokenizer.from_pretrained(model_dir)
    parts = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    text = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    inputs: dict[str, Any] = {}
    if images:
        processor = Qwen2VLImageProcessorPil(**{k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"})
        pixels = processor(images=[Image.open(io.BytesIO(im)) for im in images], return_tensors="np")
        grids = pixels["image_grid_thw"]
        counts = iter(int(np.prod(g)) // 4 for g in grids)
        pad = hf.config.image_token_id
        ids = [t for token in ids for t in ([pad] * next(counts) if token == pad else [token])]
        inputs = {"pixel_values": torch.from_numpy(pixels["pixel_values"]), "image_grid_thw": torch.from_numpy(grids),
                  "mm_token_type_ids": (torch.tensor([ids]) == pad).int()}
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False, **inputs)
    return ids, out[0, len(ids):].tolist()


def test_image_chats_next_to_a_text_chat_give_transformers_tokens(served) -> None:
    cluster, hf, model_dir = served
    requests = [("What is in the picture?", (png(64, 64, 1),)), ("Say something.", ()),
                ("Compare the two pictures.", (png(64, 96, 2), png(96, 64, 3)))]

    def chat(question: str, images: tuple[bytes, ...]) -> dict[str, Any]:
        resp = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": messages(question, *images), "temperature": 0, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        return resp.json()

    with cf.ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: chat(*r), requests))
    for body, (question, images) in zip(got, requests):
        ids, tokens = expected(hf, model_dir, question, *images)
        assert body["choices"][0]["token_ids"] == tokens
        assert body["usage"]["prompt_tokens"] == len(ids)


def test_a_streamed_image_chat_equals_the_unstreamed_one(served) -> None:
    cluster, hf, model_dir = served
    question, image = "Describe it.", png(96, 96, 4)
    body = {"model": MODEL, "messages": messages(question, image), "temperature": 0, "max_tokens": MAX_TOKENS,
            "ignore_eos": True}
    with httpx.Client() as client:
        whole = client.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=300)
        assert whole.status_code == 200, whole.text
        events = stream_events(client, f"{cluster.url}/v1/chat/completions",
                               {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole.json()["choices"][0]["message"]["content"]
    ids, _ = expected(hf, model_dir, question, image)
    assert chunks[-1]["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"] == len(ids)
    assert ids.count(hf.config.image_token_id) == 9  # a 96 x 96 image: 6 x 6 patches, 3 x 3 tokens
