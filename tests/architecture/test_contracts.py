"""The architecture of docs/architecture.md ("Packages and the allowed imports") is machine-checked: import-linter
contracts, dynamic imports the contracts cannot see, declared dependencies, and planted violations (in a temporary
copy of the sources) that each contract must catch."""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ROOT / "packages"
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent))

# Which workspace packages each package may depend on (docs/architecture.md).
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


def _run_lint(root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert LINT_IMPORTS, "lint-imports is not installed in this environment"
    env = None
    if root != ROOT:  # a copy: its sources come first on the path, ahead of the editable installs of the real ones
        paths = [str(p) for p in sorted(root.glob("packages/*/src"))] + [str(root / "src")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--config", str(root / ".importlinter")],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )


def _contracts() -> dict[str, configparser.SectionProxy]:
    """The contracts of .importlinter by id (`[importlinter:contract:<id>]`)."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    prefix = "importlinter:contract:"
    return {name[len(prefix):]: parser[name] for name in parser.sections() if name.startswith(prefix)}


def _modules(section: configparser.SectionProxy, key: str) -> list[str]:
    return section.get(key, "").split()


def _source_copy(tmp_path: Path) -> Path:
    """The Python sources (packages/*/src, src/) and .importlinter, copied: violations are planted there, never in
    the package sources (a test that dies half-way, or a run next to it, must not see them)."""
    def not_python(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n == "__pycache__" or (Path(folder, n).is_file() and not n.endswith(".py"))}

    for src in [*PACKAGES.glob("*/src"), ROOT / "src"]:
        shutil.copytree(src, tmp_path / src.relative_to(ROOT), ignore=not_python)
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


def _plant(root: Path, package: str, code: str) -> None:
    """Write `code` as module `<package>._planted_violation` of the copy at `root` (`package` may be dotted)."""
    rel = package.replace(".", "/")
    (package_dir,) = [p for p in [*root.glob(f"packages/*/src/{rel}"), root / "src" / rel] if p.is_dir()]
    (package_dir / "_planted_violation.py").write_text(code + "  # planted by tests/architecture\n")


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


# (the contract, the package a violation is planted in, the import it plants): at least one per contract, so each
# is shown to catch what it claims.
PLANTED = [
    ("package-layers", "infer_core", "infer_protocol"),
    ("package-layers", "infer_server", "infer_scheduler"),  # the processes are independent of each other
    ("worker-layers", "infer_worker.domain", "infer_worker.models"),
    ("torch-free-control-plane", "infer_server", "torch"),
    ("torch-free-control-plane", "infer_scheduler", "transformers"),
    ("scheduler-speaks-no-http", "infer_scheduler", "fastapi"),
    ("scheduler-speaks-no-http", "infer_scheduler", "uvicorn"),
    ("protocol-is-values-and-codecs", "infer_protocol", "zmq"),
    ("protocol-is-values-and-codecs", "infer_protocol", "fastapi"),
    ("backends-read-no-weight-files", "infer_backend_cpu", "safetensors"),
    ("backends-read-no-weight-files", "infer_backend_cuda", "gguf"),
    ("backends-read-no-weight-files", "infer_backend_cpu", "huggingface_hub"),
    ("backends-know-only-core", "infer_backend_cuda", "zmq"),
    ("pure-core", "infer_core", "numpy"),
    ("frontend-talks-http-only", "infer_frontend", "torch"),
    ("frontend-talks-http-only", "infer_frontend", "infer_protocol"),
    ("kernels-only-in-cuda-adapter", "infer_backend_cpu", "triton"),
    ("kernels-only-in-cuda-adapter", "rustinfer", "numba"),
    ("worker-never-imports-a-backend", "infer_worker", "infer_backend_cuda"),
    ("worker-domain-knows-only-core", "infer_worker.domain", "infer_protocol"),  # the wire stays out of the domain
    ("worker-domain-knows-only-core", "infer_worker.domain", "numpy"),
    ("worker-io-in-infrastructure", "infer_worker.domain", "safetensors"),
    ("worker-io-in-infrastructure", "infer_worker.application", "zmq"),
]


@pytest.mark.parametrize(("contract", "package", "module"), PLANTED, ids=[f"{c}:{m}" for c, _, m in PLANTED])
def test_a_planted_violation_is_caught(tmp_path: Path, contract: str, package: str, module: str) -> None:
    contracts = _contracts()
    if contracts[contract]["type"] == "forbidden":
        assert package in _modules(contracts[contract], "source_modules")
        assert module in _modules(contracts[contract], "forbidden_modules")
    root = _source_copy(tmp_path)
    _plant(root, package, f"import {module}")
    result = _run_lint(root)
    assert result.returncode != 0, result.stdout + result.stderr
    assert f"{package}._planted_violation -> {module}" in result.stdout
    summary = " ".join(result.stdout.split())  # lint-imports wraps long contract names
    broken = {cid for cid, section in contracts.items() if f"{' '.join(section['name'].split())} BROKEN" in summary}
    assert contract in broken, result.stdout


def test_every_contract_has_a_planted_violation() -> None:
    """A new contract comes with its planted violation in PLANTED."""
    assert set(_contracts()) - {c for c, _, _ in PLANTED} == set()


def test_the_sources_hold_no_planted_violation() -> None:
    assert list(PACKAGES.glob("*/src/*/_planted_violation.py")) == []


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


HEAVY = {"torch", "triton", "numba", "transformers", "safetensors"}  # never in a torch-free package, however imported


def _forbidden_for(module: str, contracts: dict[str, configparser.SectionProxy]) -> set[str]:
    """What the forbidden contracts forbid `module` (a dotted module name) to import, plus HEAVY in a torch-free
    package."""
    out = set(HEAVY) if module.split(".")[0].replace("_", "-") in TORCH_FREE else set()
    for section in contracts.values():
        if section.get("type") == "forbidden" and any(
            module == src or module.startswith(src + ".") for src in _modules(section, "source_modules")
        ):
            out |= set(_modules(section, "forbidden_modules"))
    return out


def _dynamic_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of each `importlib.import_module("x")`, `import_module("x")`, `__import__("x")` and
    `importlib.__import__("x")` with a literal name: import-linter reads `import` statements only."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func, arg = node.func, node.args[0]
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in {"import_module", "__import__"} and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            out.append((arg.value, node.lineno))
    return out


def _dynamic_import_offenders(root: Path) -> list[str]:
    offenders, contracts = [], _contracts()
    for path in sorted([*root.glob("packages/*/src/**/*.py"), *root.glob("src/**/*.py")]):
        src = next(p for p in path.parents if p.name == "src")
        module = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        forbidden = _forbidden_for(module, contracts)
        for name, line in _dynamic_imports(ast.parse(path.read_text(), filename=str(path))):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                offenders.append(f"{module}:{line} -> {name}")
    return offenders


def test_no_dynamic_import_of_a_forbidden_module() -> None:
    assert _dynamic_import_offenders(ROOT) == []


def test_a_planted_dynamic_import_is_caught(tmp_path: Path) -> None:
    root = _source_copy(tmp_path)
    _plant(root, "infer_core", 'import importlib\nimportlib.import_module("torch")')
    _plant(root, "infer_protocol", 'from importlib import import_module\nimport_module("zmq.asyncio")')
    _plant(root, "infer_server", 'torch = __import__("torch")')
    _plant(root, "infer_scheduler", 'import importlib\nimportlib.__import__("fastapi")')
    _plant(root, "infer_frontend", 'import importlib\nimportlib.import_module("transformers")')
    _plant(root, "infer_backend_cpu", 'import importlib\nimportlib.import_module("safetensors.torch")')
    _plant(root, "infer_worker", 'import importlib\nimportlib.import_module("torch")')  # the worker may
    assert _dynamic_import_offenders(root) == [
        "infer_backend_cpu._planted_violation:2 -> safetensors.torch",
        "infer_core._planted_violation:2 -> torch",
        "infer_frontend._planted_violation:2 -> transformers",
        "infer_protocol._planted_violation:2 -> zmq.asyncio",
        "infer_scheduler._planted_violation:2 -> fastapi",
        "infer_server._planted_violation:1 -> torch",
    ]


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
