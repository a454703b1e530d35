"""The architecture of DESIGN §2 is machine-checked: import-linter contracts, declared dependencies, and a
planted violation that the contracts must catch."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ROOT / "packages"
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent))

# Which workspace packages each package may depend on (DESIGN §2).
ALLOWED_WORKSPACE_DEPS: dict[str, set[str]] = {
    "infer-core": set(),
    "infer-protocol": {"infer-core"},
    "infer-server": {"infer-protocol", "infer-core"},
    "infer-scheduler": {"infer-protocol", "infer-core"},
    "infer-worker": {"infer-protocol", "infer-core"},
    "infer-backend-cpu": {"infer-core"},
    "infer-backend-cuda": {"infer-core"},
    "infer-frontend": set(),
}
TORCH_FREE = {"infer-core", "infer-protocol", "infer-server", "infer-scheduler", "infer-frontend"}
KERNEL_LIBS = {"triton", "numba", "numba-cuda"}


def _declared(package: str) -> set[str]:
    meta = tomllib.loads((PACKAGES / package / "pyproject.toml").read_text())
    names = set()
    for req in meta["project"].get("dependencies", []):
        name = req.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower())
    return names


def _run_lint() -> subprocess.CompletedProcess[str]:
    assert LINT_IMPORTS, "lint-imports is not installed in this environment"
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_package_is_in_the_allowed_graph() -> None:
    assert sorted(p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists()) == sorted(ALLOWED_WORKSPACE_DEPS)


@pytest.mark.parametrize("package", sorted(ALLOWED_WORKSPACE_DEPS))
def test_declared_dependencies_match_the_allowed_graph(package: str) -> None:
    declared = _declared(package)
    workspace = {d for d in declared if d.startswith("infer-")}
    assert workspace <= ALLOWED_WORKSPACE_DEPS[package], f"{package} declares {workspace - ALLOWED_WORKSPACE_DEPS[package]}"
    if package in TORCH_FREE:
        assert not declared & ({"torch", "transformers"} | KERNEL_LIBS), f"{package} must install without torch"
    if package != "infer-backend-cuda":
        assert not declared & KERNEL_LIBS, f"{package} must not depend on triton/numba"


def test_import_linter_contracts_are_kept() -> None:
    result = _run_lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_planted_violation_is_caught() -> None:
    planted = PACKAGES / "infer-server" / "src" / "infer_server" / "_planted_violation.py"
    planted.write_text("import torch  # planted by tests/architecture: the server must stay torch-free\n")
    try:
        result = _run_lint()
    finally:
        planted.unlink()
    assert result.returncode != 0
    assert "infer_server._planted_violation -> torch" in result.stdout


def _imports_torch_cuda(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            base = node.value
            if isinstance(base, ast.Name) and base.id == "torch":
                return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.cuda"):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names):
            return True
    return False


def test_torch_cuda_appears_only_in_the_cuda_adapter() -> None:
    """import-linter sees external packages only at the top level, so `torch.cuda` is checked here."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in PACKAGES.glob("*/src/**/*.py")
        if "infer_backend_cuda" not in p.parts and _imports_torch_cuda(p)
    ]
    assert offenders == []


def test_control_plane_imports_without_torch() -> None:
    """The torch-free control plane imports in a process where torch cannot be imported at all."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'torch', 'triton', 'numba', 'transformers'}:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pkgutil, importlib\n"
        "for pkg in ('infer_core', 'infer_protocol', 'infer_server', 'infer_scheduler'):\n"
        "    mod = importlib.import_module(pkg)\n"
        "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_every_package_builds_on_its_own(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is needed to build the packages (the README's set-up installs it)")
    for package in sorted(ALLOWED_WORKSPACE_DEPS):
        result = subprocess.run(
            [uv, "build", "--package", package, "--wheel", "--out-dir", str(tmp_path), "--offline", "--no-progress"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, f"{package}: {result.stderr[-2000:]}"
    wheels = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.whl"))
    assert wheels == sorted(name.replace("-", "_") for name in ALLOWED_WORKSPACE_DEPS)
