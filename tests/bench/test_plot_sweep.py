"""bench/plot_sweep.py on result files that bench/serve_sweep.py itself writes (against a mock streaming server)."""

from __future__ import annotations

import base64
import functools
import importlib.util
import io
import json
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.bench.scripts import BENCH, load_bench_script

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OUTPUT_TOKENS = 6


serve_sweep = load_bench_script("serve_sweep")
plot_sweep = load_bench_script("plot_sweep")


def sse(chunk: dict | str) -> str:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


def fake_chat_stream(request: httpx.Request) -> httpx.Response:
    """A streamed chat completion of OUTPUT_TOKENS one-word chunks, then the usage chunk and [DONE]."""
    events = [sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})]
    events += [sse({"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}) for i in range(OUTPUT_TOKENS)]
    events.append(sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": OUTPUT_TOKENS}}))
    events.append(sse("[DONE]"))
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content="".join(events).encode())


def record_bodies(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The fake stream answers every chat request; the list fills with their bodies."""
    bodies: list[dict] = []

    def recording(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":  # not the GET with which each client opens its connection
            bodies.append(json.loads(request.content))
        return fake_chat_stream(request)

    monkeypatch.setattr(httpx, "AsyncClient",
                        functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(recording)))
    return bodies


@pytest.fixture
def sweep_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Two series, three QPS levels each, written by serve_sweep.main() itself."""
    monkeypatch.setattr(httpx, "AsyncClient",
                        functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(fake_chat_stream)))
    paths = []
    for label in ("baseline", "candidate"):
        out = tmp_path / f"{label}.json"
        # seed 1: every level's first arrival (Poisson from the start) within its 0.2 s (0.072 s at qps 2)
        monkeypatch.setattr(sys, "argv", ["serve_sweep.py", "--model", "fake", "--qps", "2,4,8", "--duration", "0.2",
                                          "--max-tokens", str(OUTPUT_TOKENS), "--label", label, "--out", str(out),
                                          "--seed", "1"])
        serve_sweep.main()
        paths.append(out)
    return paths


def test_the_fixture_is_a_real_sweep(sweep_files: list[Path]) -> None:
    document = json.loads(sweep_files[0].read_text())
    assert [level["qps"] for level in document["levels"]] == [2.0, 4.0, 8.0]
    assert all(level["failed"] == 0 and level["output_throughput"] > 0 for level in document["levels"])


def test_two_series_make_one_png(sweep_files: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "sweep.png"
    assert plot_sweep.main([*map(str, sweep_files), "-o", str(out), "--title", "test sweep"]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > height > 500  # a 2x3 grid of panels, landscape


def test_series_are_named_by_label_else_file_stem(sweep_files: list[Path], tmp_path: Path) -> None:
    assert plot_sweep.load_sweep(sweep_files[1]).label == "candidate"
    document = json.loads(sweep_files[1].read_text())
    del document["label"]
    unlabelled = tmp_path / "h200_run7.json"
    unlabelled.write_text(json.dumps(document))
    sweep = plot_sweep.load_sweep(unlabelled)
    assert (sweep.label, sweep.max_tokens, sweep.qps()) == ("h200_run7", OUTPUT_TOKENS, [2.0, 4.0, 8.0])


@pytest.mark.parametrize("content", ['{"label": "x", "commit": "abc"}', '{"levels": [{"qps": 1}]}', "[1, 2]",
                                     "not json"])
def test_a_non_sweep_file_exits_2_with_one_line(content: str, tmp_path: Path) -> None:
    bad = tmp_path / "other.json"
    bad.write_text(content)
    result = subprocess.run([sys.executable, str(BENCH / "plot_sweep.py"), str(bad), "-o", str(tmp_path / "x.png")],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "not a serve_sweep result" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_exits_2(sweep_files: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert plot_sweep.main([str(sweep_files[0]), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("flag, expected", [([], True), (["--no-ignore-eos"], None)])
def test_ignore_eos_is_sent_unless_turned_off(flag: list[str], expected: bool | None, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """serve_sweep sends ignore_eos (the reference workload); `--no-ignore-eos` drives servers that refuse it."""
    bodies = record_bodies(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["serve_sweep.py", "--model", "fake", "--qps", "8", "--duration", "0.3",
                                      "--out", str(tmp_path / "s.json"), *flag])
    serve_sweep.main()
    assert bodies and all(b.get("ignore_eos") is expected for b in bodies)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)


def test_workloads_shape_their_prompts() -> None:
    """`long`: one user message near its size, lengths varying; `shared-prefix`: the same system prompt on every
    request and a different short question; `chat`: a 40-500 character question."""
    rng = random.Random(3)
    long = [serve_sweep.Workload("long", 12_000).messages(rng) for _ in range(20)]
    sizes = [len(m[0]["content"]) for m in long]
    assert all(m[0]["role"] == "user" and len(m) == 1 for m in long)
    assert all(10_700 <= n <= 13_300 for n in sizes) and len(set(sizes)) > 10
    shared = [serve_sweep.Workload("shared-prefix", 6_000).messages(rng) for _ in range(5)]
    assert len({m[0]["content"] for m in shared}) == 1 and abs(len(shared[0][0]["content"]) - 6_000) <= 10
    assert len({m[1]["content"] for m in shared}) == 5 and all(m[1]["role"] == "user" for m in shared)
    chat = serve_sweep.Workload().messages(rng)
    assert len(chat) == 1 and 40 <= len(chat[0]["content"]) <= 500


def test_an_image_fraction_puts_images_before_the_question() -> None:
    """About a quarter of the requests carry one of the few distinct images (a decodable JPEG data URL) before their
    question; the level reports those requests' TTFT apart."""
    rng = random.Random(5)
    requests = [serve_sweep.Workload(image_fraction=0.25, image_side=64).messages(rng) for _ in range(400)]
    with_image = [m for m in requests if isinstance(m[-1]["content"], list)]
    assert 70 <= len(with_image) <= 130
    parts = with_image[0][-1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"] and 40 <= len(parts[1]["text"]) <= 500
    urls = {m[-1]["content"][0]["image_url"]["url"] for m in with_image}
    assert 2 <= len(urls) <= serve_sweep.IMAGE_POOL
    from PIL import Image
    header, data = next(iter(urls)).split(",", 1)
    assert header == "data:image/jpeg;base64"
    assert Image.open(io.BytesIO(base64.b64decode(data))).size == (64, 64)
    records = [serve_sweep.RequestRecord(ok=True, ttft=0.5, image=True), serve_sweep.RequestRecord(ok=True, ttft=0.1)]
    assert serve_sweep._image_stats(records) == {
        "image_requests": 1, "ttft_image_ms": {"mean": 500.0, "p50": 500.0, "p90": 500.0, "p99": 500.0}}
    assert serve_sweep._image_stats(records[1:]) == {}


def test_prompt_size_comes_from_the_servers_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three characters a token by the server's count; 4.0 when the server has no /tokenize."""
    def tokenize(request: httpx.Request) -> httpx.Response:
        chars = len(json.loads(request.content)["prompt"])
        return httpx.Response(200, json={"count": chars // 3, "tokens": []})

    client = httpx.Client(transport=httpx.MockTransport(tokenize))
    monkeypatch.setattr(httpx, "post", client.post)
    assert serve_sweep.chars_per_token("http://x", "m") == pytest.approx(3.0, rel=0.01)
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(404, json={})))
    monkeypatch.setattr(httpx, "post", client.post)
    assert serve_sweep.chars_per_token("http://x", "m") == 4.0


def test_image_ttft_sends_one_distinct_image_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--image-ttft N`: a warm-up and N requests, each one image (never the same twice: a repeat would hit the
    prefix cache) then the short question; the result holds each TTFT and their median."""
    bodies = record_bodies(monkeypatch)
    out = tmp_path / "ttft.json"
    monkeypatch.setattr(sys, "argv", ["serve_sweep.py", "--model", "fake", "--image-ttft", "3", "--image-side", "64",
                                      "--max-tokens", "8", "--out", str(out)])
    serve_sweep.main()
    assert len(bodies) == 4
    contents = [b["messages"][0]["content"] for b in bodies]
    assert all([p["type"] for p in c] == ["image_url", "text"] and c[1]["text"] == serve_sweep.QUESTION
               for c in contents)
    assert len({c[0]["image_url"]["url"] for c in contents}) == 4
    result = json.loads(out.read_text())
    assert result["image"] == "64x64" and result["repeats"] == 3 and result["prompt_tokens"] == 9
    assert len(result["ttft_ms"]) == 3 and result["ttft_ms_median"] == sorted(result["ttft_ms"])[1] > 0


def fake_completion_stream(request: httpx.Request) -> httpx.Response:
    """A streamed /v1/completions answer of OUTPUT_TOKENS text chunks, the usage chunk (the prompt's length), [DONE]."""
    prompt = json.loads(request.content)["prompt"]
    events = [sse({"choices": [{"index": 0, "text": f"w{i} "}]}) for i in range(OUTPUT_TOKENS)]
    events.append(sse({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": OUTPUT_TOKENS}}))
    events.append(sse("[DONE]"))
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content="".join(events).encode())


def test_prompt_ttft_sends_distinct_token_id_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--prompt-ttft N`: a short warm-up, then N completions of `--prompt-tokens` token ids (never the same twice: a
    repeat would hit the prefix cache); the result holds each TTFT and their median."""
    requests: list[httpx.Request] = []

    def recording(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return fake_completion_stream(request)

    monkeypatch.setattr(httpx, "AsyncClient",
                        functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(recording)))
    out = tmp_path / "ttft.json"
    monkeypatch.setattr(sys, "argv", ["serve_sweep.py", "--model", "fake", "--prompt-ttft", "3", "--prompt-tokens",
                                      "500", "--vocab", "1000", "--max-tokens", "4", "--out", str(out)])
    serve_sweep.main()
    assert [r.url.path for r in requests] == ["/v1/completions"] * 4
    prompts = [json.loads(r.content)["prompt"] for r in requests]
    assert [len(p) for p in prompts] == [16, 500, 500, 500]
    assert len({tuple(p) for p in prompts}) == 4 and all(0 <= t < 1000 for p in prompts for t in p)
    assert all(json.loads(r.content)["stream"] for r in requests)
    result = json.loads(out.read_text())
    assert result["prompt_ttft_tokens"] == 500 and result["repeats"] == 3 and result["prompt_tokens"] == 500
    assert len(result["ttft_ms"]) == 3 and result["ttft_ms_median"] == sorted(result["ttft_ms"])[1] > 0
