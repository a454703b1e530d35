"""The lock and the pyprojects install on any machine: no local paths, PyPI only, the promised platforms."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = sorted([ROOT / "pyproject.toml", *ROOT.glob("packages/*/pyproject.toml")])
PYPI = "https://pypi.org/simple"
# An absolute POSIX or Windows path, a home-relative path, or a file URL, anywhere in a quoted TOML string.
MACHINE_PATH = re.compile(r'"(?:/|~|[A-Za-z]:[\\/])[^"]*"|file://')


def _load(path: Path) -> dict:
    with path.open("rb") as fh:
        return tomllib.load(fh)


@pytest.mark.parametrize("path", [ROOT / "uv.lock", *PYPROJECTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_machine_path(path: Path) -> None:
    found = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert not found, f"{path.relative_to(ROOT)} names paths outside the repository:\n" + "\n".join(found)


def test_the_machine_path_pattern_catches_what_it_claims() -> None:
    for line in ('torch = { path = "/opt/wheels/torch.whl" }', 'source = { url = "file:///tmp/x.whl" }',
                 'x = { path = "~/wheels/a.whl" }', 'x = { path = "C:\\\\wheels\\\\a.whl" }'):
        assert MACHINE_PATH.search(line), line
    assert not MACHINE_PATH.search('source = { editable = "packages/infer-core" }')


def test_every_locked_package_comes_from_pypi_or_the_workspace() -> None:
    lock = _load(ROOT / "uv.lock")
    for package in lock["package"]:
        source = package["source"]
        if "registry" in source:
            assert source["registry"] == PYPI, package["name"]
        else:
            assert set(source) <= {"editable", "virtual"}, (package["name"], source)
            assert not Path(next(iter(source.values()))).is_absolute(), package["name"]


def test_the_lock_covers_linux_x86_64_and_aarch64_and_macos_arm64() -> None:
    lock = _load(ROOT / "uv.lock")
    assert sorted(lock["supported-markers"]) == [
        "platform_machine == 'aarch64' and sys_platform == 'linux'",
        "platform_machine == 'arm64' and sys_platform == 'darwin'",
        "platform_machine == 'x86_64' and sys_platform == 'linux'",
    ]
    torch = next(p for p in lock["package"] if p["name"] == "torch")
    wheels = [w["url"].rsplit("/", 1)[1] for w in torch["wheels"]]
    for python in ("cp311", "cp312", "cp313"):
        for platform in ("manylinux_2_28_x86_64", "manylinux_2_28_aarch64", "macosx_14_0_arm64"):
            assert any(python in w and platform in w for w in wheels), (python, platform)
    assert not any("+cpu" in w for w in wheels), "PyPI's default torch on Linux is the CUDA build"


def test_requires_python_agrees_everywhere() -> None:
    ranges = {str(p.relative_to(ROOT)): _load(p)["project"]["requires-python"] for p in PYPROJECTS}
    assert set(ranges.values()) == {">=3.11,<3.14"}, ranges
    assert _load(ROOT / "uv.lock")["requires-python"] == ">=3.11, <3.14"


def test_kernel_libraries_are_linux_only_so_macos_gets_the_cpu_backend() -> None:
    cuda = _load(ROOT / "packages/infer-backend-cuda/pyproject.toml")["project"]["dependencies"]
    for name in ("triton", "numba-cuda"):
        requirement = next(d for d in cuda if d.startswith(name))
        assert "sys_platform == 'linux'" in requirement, requirement
    root = _load(ROOT / "pyproject.toml")["project"]["dependencies"]
    assert "infer-backend-cuda; sys_platform == 'linux'" in root
    assert "infer-backend-cpu" in root
