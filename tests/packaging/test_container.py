"""The container image definition (not buildable here: no container engine) agrees with the README and the config."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from infer_protocol.config import FIELDS

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions(keyword: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)  # continuation lines
    return [line[len(keyword):].strip() for line in joined.splitlines() if line.startswith(keyword + " ")]


def _readme_setup_command() -> list[str]:
    commands = re.findall(r"```bash\n(.*?)\n", (ROOT / "README.md").read_text())
    serve = next(c for c in commands if "rustinfer serve" in c)
    return shlex.split(serve.split("&&")[0])


def test_it_installs_with_the_readmes_setup_command_from_the_lock() -> None:
    setup = _readme_setup_command()
    assert setup == ["uv", "sync"]
    installs = [shlex.split(run.split("&&")[0]) for run in _instructions("RUN") if "uv" in run]
    assert len(installs) == 1 and installs[0][:2] == setup, installs
    assert "--locked" in installs[0]


def test_it_is_an_official_cuda_runtime_image_serving_on_8000() -> None:
    (base,) = _instructions("FROM")
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", base), base
    assert _instructions("EXPOSE") == ["8000"]
    assert _instructions("ENTRYPOINT") == ['["rustinfer", "serve"]']


def test_its_health_check_asks_ready() -> None:
    (check,) = _instructions("HEALTHCHECK")
    assert re.search(r"CMD curl -fsS \"http://127\.0\.0\.1:\$\{RUSTINFER_PORT\}/ready\"", check), check


def test_every_rustinfer_variable_it_sets_is_a_config_field() -> None:
    names = re.findall(r"\bRUSTINFER_([A-Z0-9_]+)=", DOCKERFILE)
    assert names, "the image sets RUSTINFER_HOST so that the server is reachable from outside"
    assert "HOST" in names
    for name in names:
        assert name.lower() in FIELDS, name
