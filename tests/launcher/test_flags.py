"""The entry points' command lines: `rustinfer --version`, `rustinfer serve --help`, and the config flags refused
with the config file's one-line error by `rustinfer serve` and the three process CLIs alike."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from infer_protocol.config_cli import _shown, field_specs
from rustinfer.launcher import child_environ, main

RUSTINFER = Path(sys.executable).parent / "rustinfer"
_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RUSTINFER_")}


def _rustinfer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RUSTINFER), *args], capture_output=True, text=True, timeout=60, env=_ENV)


def test_version() -> None:
    result = _rustinfer("--version")
    assert result.returncode == 0, result
    assert result.stdout.startswith(f"rustinfer {metadata.version('rustinfer')}")
    assert f"infer-protocol {metadata.version('infer-protocol')}" in result.stdout


def test_serve_help_lists_every_field_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert "--max-model-len N context limit (prompt + completion)" in help_text
    for spec in field_specs():
        assert spec.flag in help_text
        assert f"(default: {_shown(spec.default)})" in help_text


def test_a_bad_flag_value_is_one_line_like_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('max_model_len = "abc"\n')
    from_flag = _rustinfer("serve", "--max-model-len", "abc")
    from_file = _rustinfer("serve", "--config", str(bad))
    assert from_flag.returncode == 2, from_flag
    assert from_flag.stderr == from_file.stderr
    assert from_flag.stderr.startswith("rustinfer: invalid config: ") and "max_model_len" in from_flag.stderr
    assert len(from_flag.stderr.splitlines()) == 1 and "Traceback" not in from_flag.stderr


def _server(argv: list[str]) -> Any:
    from infer_server.cli import main as server_main
    return server_main(argv)


def _scheduler(argv: list[str]) -> Any:
    from infer_scheduler.cli import main as scheduler_main
    return scheduler_main(argv)


def _worker(argv: list[str]) -> Any:
    from infer_worker.cli import main as worker_main
    try:
        return worker_main(argv)
    except SystemExit as exc:  # the worker's main exits instead of returning
        return exc.code


@pytest.mark.parametrize("process_main", [_server, _scheduler, _worker], ids=["server", "scheduler", "worker"])
def test_process_clis_take_the_config_flags(process_main: Callable[[list[str]], Any],
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("RUSTINFER_")]:
        monkeypatch.delenv(key)
    assert process_main(["--max-batch-seqs", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'max_batch_seqs' must be > 0, got -1" in err


def test_the_processes_do_not_get_the_config_variables() -> None:
    # `RUSTINFER_PORT=9000 rustinfer serve --port 8001`: the file the processes read says 8001, and an inherited
    # RUSTINFER_PORT would beat it there (env > file), putting the server where the launcher does not look.
    assert child_environ({"RUSTINFER_PORT": "9000", "PATH": "/bin", "INFER_CUDA_PDL": "0"}) == {
        "PATH": "/bin", "INFER_CUDA_PDL": "0"}
