"""Penalties, logit_bias, allowed_token_ids, min_tokens, logprobs and echo end to end: the three real processes
serving the embedded SmolLM2 on the CPU backend, checked against themselves, against HF transformers, and across
batch neighbours."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import ServedCluster
from tests.e2e.sse import stream_events

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
REPEATING = "The cat sat on the mat. The cat sat on the mat. The cat"  # greedy SmolLM2 keeps repeating it


def _post(cluster: ServedCluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{cluster.url}{path}", json={"model": MODEL} | body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_greedy_chat_logprobs(smol_cluster: ServedCluster) -> None:
    body = {"messages": FRANCE, "temperature": 0, "max_tokens": 12}
    plain = _post(smol_cluster, "/v1/chat/completions", body)["choices"][0]
    choice = _post(smol_cluster, "/v1/chat/completions", body | {"logprobs": True, "top_logprobs": 5})["choices"][0]
    assert choice["message"]["content"] == plain["message"]["content"]  # asking for logprobs changes no token
    assert plain["logprobs"] is None
    content = choice["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == choice["message"]["content"]
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 5
        assert entry["logprob"] <= 0
        assert tops[0]["token"] == entry["token"]  # greedy: the sampled token is the most likely one
        assert tops[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)


def test_streamed_completion_logprobs_equal_the_non_streamed(smol_cluster: ServedCluster) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6, "logprobs": 2}
    full = _post(smol_cluster, "/v1/completions", body)["choices"][0]
    with httpx.Client() as client:
        events = stream_events(client, f"{smol_cluster.url}/v1/completions", body | {"stream": True})
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events[:-1]:
        lp = e["choices"][0]["logprobs"] if e["choices"] else None
        if lp is not None:
            for key in merged:
                merged[key] += lp[key]
    assert "".join(full["logprobs"]["tokens"]) == full["text"]
    assert merged["tokens"] == full["logprobs"]["tokens"] and merged["text_offset"] == full["logprobs"]["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(full["logprobs"]["token_logprobs"], abs=1e-4)
    for token, lp, top in zip(full["logprobs"]["tokens"], full["logprobs"]["token_logprobs"],
                              full["logprobs"]["top_logprobs"]):
        assert 2 <= len(top) <= 3 and top[token] == pytest.approx(lp, abs=1e-4) and max(top.values()) == pytest.approx(lp, abs=1e-4)


def test_logit_bias_equals_hf_sequence_bias(smol_cluster: ServedCluster, embedded_model_dir: Path) -> None:
    """Greedy with logit_bias against HF's `sequence_bias` on one-token sequences (an additive bias): the repeated
    " cat" pushed down, " dog" pulled up; the unbiased neighbour in the same batch is unaffected."""
    transformers = pytest.importorskip("transformers")
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(embedded_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    prompt_ids = tok(REPEATING)["input_ids"]
    (cat,), (dog,) = tok(" cat")["input_ids"], tok(" dog")["input_ids"]
    bias = {cat: -30.0, dog: 12.0}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False,
                             sequence_bias={(t,): b for t, b in bias.items()})
    expected = out[0, len(prompt_ids):].tolist()
    body = {"prompt": prompt_ids, "temperature": 0, "max_tokens": 12, "return_token_ids": True, "ignore_eos": True}
    with cf.ThreadPoolExecutor(2) as pool:
        plain_f = pool.submit(_post, smol_cluster, "/v1/completions", body)
        biased_f = pool.submit(_post, smol_cluster, "/v1/completions",
                               body | {"logit_bias": {str(t): b for t, b in bias.items()}})
        plain, biased = plain_f.result()["choices"][0], biased_f.result()["choices"][0]
    assert plain["text"].startswith(" sat on the mat. The cat")  # unbiased, it repeats " cat"
    assert biased["token_ids"] == expected
    assert cat not in biased["token_ids"] and dog in biased["token_ids"]


def test_allowed_token_ids_equal_hf_prefix_allowed_tokens(smol_cluster: ServedCluster,
                                                          embedded_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(embedded_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    prompt_ids = tok(REPEATING)["input_ids"]
    allowed = sorted({t for w in (" dog", " ran", " far", " away", ".") for t in tok(w)["input_ids"]})
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=10, do_sample=False,
                             prefix_allowed_tokens_fn=lambda _batch, _ids: allowed)
    expected = out[0, len(prompt_ids):].tolist()
    body = {"prompt": prompt_ids, "temperature": 0, "max_tokens": 10, "return_token_ids": True, "ignore_eos": True}
    got = _post(smol_cluster, "/v1/completions", body | {"allowed_token_ids": allowed})["choices"][0]["token_ids"]
    assert got == expected and set(got) <= set(allowed)
    sampled = _post(smol_cluster, "/v1/completions", body | {"allowed_token_ids": allowed, "temperature": 1.0,
                                                             "seed": 3})["choices"][0]["token_ids"]
    assert set(sampled) <= set(allowed)


def test_repetition_penalty_equals_hf_transformers(smol_cluster: ServedCluster, embedded_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(embedded_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    prompt_ids = tok(REPEATING)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, repetition_penalty=1.3)
    expected = out[0, len(prompt_ids):].tolist()
    body = {"prompt": prompt_ids, "temperature": 0, "max_tokens": 16, "return_token_ids": True, "ignore_eos": True}
    plain = _post(smol_cluster, "/v1/completions", body)["choices"][0]
    penalised = _post(smol_cluster, "/v1/completions", body | {"repetition_penalty": 1.3})["choices"][0]
    assert plain["text"].startswith(" sat on the mat. The cat sat on the mat.")  # it repeats without the penalty
    assert penalised["token_ids"] == expected
    assert penalised["token_ids"] != plain["token_ids"]


def test_min_tokens_holds_back_eos(smol_cluster: ServedCluster) -> None:
    body = {"messages": FRANCE, "temperature": 0, "max_tokens": 24, "return_token_ids": True}
    free = _post(smol_cluster, "/v1/chat/completions", body)
    n_free = free["usage"]["completion_tokens"]
    assert free["choices"][0]["finish_reason"] == "stop" and n_free < 16
    eos = free["choices"][0]["token_ids"][-1]
    held = _post(smol_cluster, "/v1/chat/completions", body | {"min_tokens": 16})
    ids = held["choices"][0]["token_ids"]
    assert held["usage"]["completion_tokens"] >= 16
    assert eos not in ids[:16]
    assert ids[: n_free - 1] == free["choices"][0]["token_ids"][:-1]  # the same answer up to where EOS was masked


def test_stop_token_ids_apply_with_ignore_eos(smol_cluster: ServedCluster) -> None:
    """ignore_eos only drops EOS: the client's own stop_token_ids still end the request (vLLM semantics)."""
    body = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 12, "return_token_ids": True,
            "ignore_eos": True}
    free = _post(smol_cluster, "/v1/completions", body)["choices"][0]
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 12
    stop_id = free["token_ids"][4]
    first = free["token_ids"].index(stop_id)
    stopped = _post(smol_cluster, "/v1/completions", body | {"stop_token_ids": [stop_id]})["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == free["token_ids"][:first + 1]


def test_echo_prepends_the_prompt(smol_cluster: ServedCluster) -> None:
    body = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 4}
    plain = _post(smol_cluster, "/v1/completions", body)["choices"][0]["text"]
    echoed = _post(smol_cluster, "/v1/completions", body | {"echo": True})["choices"][0]["text"]
    assert echoed == "The capital of France is" + plain


def test_echo_logprobs_score_the_prompt_like_hf(smol_cluster: ServedCluster, embedded_model_dir: Path) -> None:
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 1, a batch of token prompts): every prompt
    token after the first gets HF transformers' log_softmax, also when the prefix cache holds the prompt."""
    transformers = pytest.importorskip("transformers")
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(embedded_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    ids = tok(REPEATING + " on the mat, and the dog sat by the door.")["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    body = {"temperature": 0, "max_tokens": 1, "ignore_eos": True}
    _post(smol_cluster, "/v1/completions", body | {"prompt": ids})  # the prompt's pages into the prefix cache
    choices = _post(smol_cluster, "/v1/completions", body | {"prompt": [ids, ids[:5]], "echo": True,
                                                             "logprobs": 2})["choices"]
    lp = choices[0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))] + [ref[-1].max().item()]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-3)
    for p in range(1, len(ids)):  # the two most likely alternatives, and the prompt token itself
        top = lp["top_logprobs"][p]
        best = ref[p - 1].topk(2).indices.tolist()
        assert set(top) == {tok.decode([t]) for t in best + [ids[p]]}
        assert max(top.values()) == pytest.approx(ref[p - 1].max().item(), abs=1e-3)
    assert choices[1]["logprobs"]["token_logprobs"][1:5] == pytest.approx(want[:4], abs=1e-3)
    # max_tokens 0 (the older clients' form): the prompt's entries only
    scored = _post(smol_cluster, "/v1/completions", body | {"prompt": ids, "echo": True, "logprobs": 2,
                                                            "max_tokens": 0})
    assert scored["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(want[:-1], abs=1e-3)
    assert scored["usage"]["completion_tokens"] == 0 and scored["choices"][0]["text"] == tok.decode(ids)


SEEDED = {"prompt": "Once upon a time", "temperature": 0.8, "seed": 7, "max_tokens": 12, "return_token_ids": True,
          "ignore_eos": True}
NEIGHBOURS = [
    {"prompt": "The weather today", "temperature": 1.0, "seed": 1, "presence_penalty": 1.0},
    {"prompt": "My favourite food is", "temperature": 0.7, "top_p": 0.9, "frequency_penalty": 0.5},
    {"prompt": "In 1492", "temperature": 0, "repetition_penalty": 1.2},
    {"prompt": "Dear diary,", "temperature": 0.9, "top_k": 20, "logprobs": 3},
    {"prompt": "def fib(n):", "temperature": 0.5, "min_tokens": 10},
    {"prompt": "Once upon a time", "temperature": 0.8, "seed": 8},
]


def test_seeded_sampling_is_independent_of_batch_neighbours(smol_cluster: ServedCluster) -> None:
    alone = _post(smol_cluster, "/v1/completions", SEEDED)["choices"][0]["token_ids"]
    with cf.ThreadPoolExecutor(len(NEIGHBOURS) + 1) as pool:
        others = [pool.submit(_post, smol_cluster, "/v1/completions",
                              n | {"max_tokens": 14, "ignore_eos": True}) for n in NEIGHBOURS]
        batched = pool.submit(_post, smol_cluster, "/v1/completions", SEEDED)
        assert batched.result()["choices"][0]["token_ids"] == alone
        for f in others:
            assert f.result()["usage"]["completion_tokens"] == 14
    again = _post(smol_cluster, "/v1/completions", SEEDED | {"seed": 8})["choices"][0]["token_ids"]
    assert again != alone  # the seed matters
