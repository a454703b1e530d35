"""The DEALER client on its own, against the fake scheduler over real ZMQ IPC."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from infer_protocol.config import load_config
from infer_protocol.messages import Pong, RequestError, SamplingParams, Submit, TokenOutput
from infer_server.scheduler_client import SchedulerClient, SchedulerUnavailable
from infer_server.tokenizer import Tokenizer
from tests.server.conftest import marker_responder
from tests.server.fake_scheduler import FakeScheduler


def _submit(tok: Tokenizer, rid: str, prompt: str, max_tokens: int = 50) -> Submit:
    return Submit(request_id=rid, prompt_token_ids=tok.encode(prompt), sampling=SamplingParams(seed=1),
                  max_tokens=max_tokens, stop_token_ids=[tok.token_to_id("<|im_end|>") or 0])


def test_client_roundtrip_abort_and_close(model_dir: Path, tokenizer: Tokenizer) -> None:
    ipc_dir = tempfile.mkdtemp(prefix="ri-")
    config = load_config(environ={}, overrides={"cluster_id": f"c{uuid.uuid4().hex[:8]}", "ipc_dir": ipc_dir,
                                                "heartbeat_interval_secs": 0.02})
    fake = FakeScheduler(config, str(model_dir), marker_responder(tokenizer), vocab_size=tokenizer.vocab_size)
    fake.start()

    async def main() -> None:
        client = SchedulerClient(config)
        with pytest.raises(SchedulerUnavailable):
            client.submit(_submit(tokenizer, "early", "hi"))
        pongs: list[Pong] = []
        client.add_pong_listener(pongs.append)
        await client.start()
        while not client.ready:
            await asyncio.sleep(0.01)
        assert pongs and pongs[-1].model is not None and client.model_info == pongs[-1].model
        assert client.last_pong is not None and client.last_pong.stats.num_running == 3

        handle = client.submit(_submit(tokenizer, "r1", "hi"))
        tokens: list[int] = []
        while True:
            event = await handle.get()
            assert isinstance(event, TokenOutput)
            tokens += event.token_ids
            if event.finish_reason:
                break
        assert event.finish_reason == "stop" and handle.finished and client.num_inflight == 0
        handle.close()  # finished: no Abort
        assert "r1" not in fake.aborts

        with pytest.raises(ValueError):  # duplicate ids are a programming error
            h = client.submit(_submit(tokenizer, "r2", "HANG"))
            client.submit(_submit(tokenizer, "r2", "HANG"))
        h.close()
        assert fake.wait_for(lambda: "r2" in fake.aborts)

        failing = client.submit(_submit(tokenizer, "r3", "FAIL"))
        err = await failing.get()
        assert isinstance(err, RequestError) and err.code == "engine_failed" and err.status == 500

        timed = client.submit(_submit(tokenizer, "r4", "HANG"), timeout=0.05)
        err = await timed.get()
        assert isinstance(err, RequestError) and err.code == "timeout" and err.status == 504
        timed.close()
        assert fake.wait_for(lambda: "r4" in fake.aborts)

        pending = client.submit(_submit(tokenizer, "r5", "HANG"))
        await client.close()  # in-flight requests fail instead of hanging
        err = await pending.get()
        assert isinstance(err, RequestError) and err.code == "server_shutdown"

    try:
        asyncio.run(main())
    finally:
        fake.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)
