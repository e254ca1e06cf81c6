"""The import graph of kvserve (DESIGN.md section 1), read from the source:
no cycle between packages, ``plan/`` a leaf of arithmetic that imports no
runtime package and that no runtime package imports, the tools (``plan/``,
``bench/``, the CLI) above everything. Every import counts, including the
lazy ones inside functions and those under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvserve

ROOT = Path(kvserve.__file__).parent
# packages and modules that only tools may import
TOOLS = {"plan", "bench", "cli"}
# what plan/ may import besides itself and the standard library (matplotlib only
# inside plot.py's functions, an optional extra)
PLAN_MAY_IMPORT = {"kvserve.config", "kvserve.param_count", "matplotlib"}


def _unit(module: str) -> str:
    """``kvserve.plan.counts`` -> ``plan``; ``kvserve.config`` -> ``config``;
    ``kvserve`` (its ``__init__``) -> ``kvserve``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from kvserve import X``
    counts as ``kvserve.X`` when X is a submodule, else as ``kvserve``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kvserve":
                for alias in node.names:
                    is_module = ((ROOT / alias.name).is_dir()
                                 or (ROOT / f"{alias.name}.py").exists())
                    names.add(f"kvserve.{alias.name}" if is_module else "kvserve")
            else:
                names.add(node.module)
    return names


def _graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the modules of the first that import the second."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in ROOT.rglob("*.py"):
        module = _module_name(path)
        source = _unit(module)
        for name in _imports(path):
            if name == "kvserve" or name.startswith("kvserve."):
                target = _unit(name)
                if target != source:
                    graph.setdefault(source, {}).setdefault(target, set()).add(module)
    return graph


def _cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of units, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(unit: str, stack: list[str]) -> list[str] | None:
        state[unit] = 1
        for target in sorted(graph.get(unit, {})):
            if state.get(target) == 1:
                return [*stack[stack.index(target):], unit, target]
            if target not in state:
                found = visit(target, [*stack, unit])
                if found:
                    return found
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state:
            found = visit(unit, [])
            if found:
                return found
    return None


def test_no_package_imports_itself_back() -> None:
    graph = _graph()
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or []) + ": " + "; ".join(
        f"{a} -> {b} in {sorted(graph[a][b])}" for a, b in zip(cycle or [], (cycle or [])[1:]))


def test_runtime_packages_never_import_the_tools() -> None:
    bad = {(source, target, tuple(sorted(modules)))
           for source, targets in _graph().items() if source not in TOOLS | {"kvserve"}
           for target, modules in targets.items() if target in TOOLS}
    assert not bad, bad


def test_plan_is_arithmetic_over_the_config_alone() -> None:
    """plan/ imports the standard library, kvserve.config and param_count, and
    itself: no torch, numpy, runtime package or bench/."""
    stdlib = sys.stdlib_module_names
    for path in (ROOT / "plan").rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            allowed = (top in stdlib or name in PLAN_MAY_IMPORT
                       or name.startswith("kvserve.plan") or name.startswith("matplotlib."))
            assert allowed, f"{_module_name(path)} imports {name}"
    assert not (ROOT / "plan" / "measure.py").exists()  # the measuring lives in bench/


def test_importing_plan_loads_no_torch() -> None:
    code = ("import sys, pkgutil, importlib, kvserve.plan as p\n"
            "for m in pkgutil.iter_modules(p.__path__):\n"
            "    importlib.import_module(f'kvserve.plan.{m.name}')\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
