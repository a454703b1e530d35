"""Fixtures for the server tests: the tiny model directory and a real server harness (uvicorn on a free port
+ the real app + the real DEALER client + the fake scheduler, over real ZMQ IPC)."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from infer_protocol.config import Config, load_config
from infer_protocol.messages import RequestError, Submit
from infer_server.app import create_app
from infer_server.tokenizer import Tokenizer

from tests.server.fake_scheduler import FakeScheduler, Reply
from tests.server.tiny_model import write_model_dir

ANSWER = "Hello world! 🙂 The capital of France is Paris."
MAX_MODEL_LEN = 128


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-model") / "tiny-chat")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def marker_responder(tok: Tokenizer) -> Callable[[Submit], Reply]:
    """Scripts by markers in the prompt: HANG (no tokens), FAIL (RequestError), SLOW (a token every 10 steps,
    never EOS), LONG (never EOS), else ANSWER+EOS."""
    answer = tok.encode(ANSWER, add_special_tokens=False)
    eos = tok.token_to_id("<|im_end|>")
    filler = tok.token_to_id("a")
    assert eos is not None and filler is not None

    def respond(sub: Submit) -> Reply:
        prompt = tok.decode(sub.prompt_token_ids, skip_special_tokens=False)
        if "HANG" in prompt:
            return Reply([], filler, hang=True)
        if "FAIL" in prompt:
            return Reply([], filler, error=RequestError(sub.request_id, code="engine_failed", message="scripted failure", status=500))
        if "SLOW" in prompt:
            return Reply(answer, filler, every=10)
        if "LONG" in prompt:
            return Reply(answer, filler)
        return Reply(answer + [eos], filler)

    return respond


class ServerHarness:
    def __init__(self, model_dir: Path, tok: Tokenizer, *, start_scheduler: bool = True, ready: bool = True,
                 step_interval: float = 0.002, images: bool = False, **overrides: Any) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="ri-")  # short: unix socket paths are limited to ~107 bytes
        base: dict[str, Any] = {
            "cluster_id": f"t{uuid.uuid4().hex[:10]}",
            "ipc_dir": self.ipc_dir,
            "port": free_port(),
            "heartbeat_interval_secs": 0.05,
            "scheduler_timeout_secs": 3.0,
            "log_level": "warning",
        }
        base.update(overrides)
        self.config: Config = load_config(overrides=base, environ={})
        self.fake = FakeScheduler(self.config, str(model_dir), marker_responder(tok), max_model_len=MAX_MODEL_LEN,
                                  vocab_size=tok.vocab_size, step_interval=step_interval, ready=ready, images=images)
        self.app = create_app(self.config)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.config.port, log_level="warning", lifespan="on",
            loop="auto", http="auto", timeout_graceful_shutdown=1,  # uvloop + httptools, as in production
        ))
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.http = httpx.Client(base_url=self.url, timeout=10)
        self._scheduler_started = False
        if start_scheduler:
            self.start_scheduler()
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def start_scheduler(self) -> None:
        self.fake.start()
        self._scheduler_started = True

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.http.get("/ready").status_code == 200:
                return
            time.sleep(0.02)
        raise AssertionError(f"server not ready: {self.http.get('/ready').text}")

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self._thread.join(10)
        if self._scheduler_started:
            self.fake.stop()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@pytest.fixture
def make_server(model_dir: Path, tokenizer: Tokenizer) -> Iterator[Callable[..., ServerHarness]]:
    made: list[ServerHarness] = []

    def make(**kwargs: Any) -> ServerHarness:
        h = ServerHarness(model_dir, tokenizer, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.stop()


@pytest.fixture(scope="module")
def server(model_dir: Path, tokenizer: Tokenizer) -> Iterator[ServerHarness]:
    h = ServerHarness(model_dir, tokenizer)
    h.wait_ready()
    yield h
    h.stop()
