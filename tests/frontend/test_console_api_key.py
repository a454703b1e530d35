"""The console sends the API key kept in localStorage as `Authorization: Bearer` (app.js run in node against a
stand-in DOM that accepts anything, so this runs without a browser; the browser test covers the chat request)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from infer_frontend import static_dir

NODE = shutil.which("node")
STUB = Path(__file__).with_name("console_stub.js")


def _startup_fetches(storage: dict[str, str]) -> list[dict[str, object]]:
    out = subprocess.run([str(NODE), str(STUB), str(Path(static_dir()) / "app.js"), json.dumps(storage)],
                         capture_output=True, text=True, timeout=60, check=True)
    return list(json.loads(out.stdout))


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_stored_key_goes_with_every_api_request() -> None:
    fetches = _startup_fetches({"rustinfer.api_key": " sk-console-1 "})
    by_url = {f["url"]: f["headers"] for f in fetches}
    assert "/v1/models" in by_url, fetches
    assert by_url["/v1/models"] == {"Authorization": "Bearer sk-console-1"}
    assert all(h == {"Authorization": "Bearer sk-console-1"} for h in by_url.values())


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_no_key_no_header() -> None:
    fetches = _startup_fetches({})
    assert fetches and all(f["headers"] == {} for f in fetches)
