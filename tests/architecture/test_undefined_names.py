"""Every name a module's code reads is defined somewhere Python will find it (the module, its imports, builtins).

Code that only runs on a GPU (the CUDA backend's methods, device-only branches) is never executed by the CPU suite,
so a missing import there surfaced first on the H200, as a worker that could not start. This reads each module's
symbol tables instead of running it."""

from __future__ import annotations

import builtins
import symtable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "packages").glob("*/src/**/*.py")) + sorted((ROOT / "bench").glob("*.py"))
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__package__", "__loader__",
                  "__builtins__", "__annotations__", "__dict__", "__class__"}


def _module_names(table: symtable.SymbolTable) -> set[str]:
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}


def _undefined(table: symtable.SymbolTable, defined: set[str]) -> set[str]:
    missing = set()
    for sym in table.get_symbols():
        name = sym.get_name()
        if sym.is_referenced() and (sym.is_global() or table.get_type() == "module") and not sym.is_assigned() \
                and not sym.is_imported() and name not in defined:
            missing.add(name)
    for child in table.get_children():
        missing |= _undefined(child, defined)
    return missing


def undefined_names(path: Path) -> set[str]:
    source = path.read_text()
    table = symtable.symtable(source, str(path), "exec")
    defined = _module_names(table) | set(dir(builtins)) | MODULE_DUNDERS
    if "import *" in source:  # a star import defines what it defines: not checkable here
        return set()
    return _undefined(table, defined)


def test_every_module_defines_what_it_reads() -> None:
    assert len(SOURCES) > 100
    problems = {str(p.relative_to(ROOT)): sorted(names) for p in SOURCES if (names := undefined_names(p))}
    assert not problems, problems


def test_the_check_sees_a_missing_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nclass A:\n    def f(self):\n        return helper(os.sep)\n")
    assert undefined_names(bad) == {"helper"}
