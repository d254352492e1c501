"""The layout is the architecture: imports point one way, down the data flow (docs/architecture.md).

Read from the source with ``ast``, not by importing: every ``import`` and ``from ... import``
of a project module, at module level or inside a function, ``TYPE_CHECKING`` blocks included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package -> the project packages it may import (its own modules aside). The data flow:
#: results files -> tables -> model runtime and features -> controller -> training -> CLI;
#: synthetic results, the testbed and the profiler produce inputs beside that flow.
ALLOWED = {
    "pipeline": set(),
    "synthetic": {"pipeline", "runtime"},
    "runtime": {"pipeline"},
    "testbed": {"pipeline", "runtime"},
    "features": {"pipeline", "runtime"},
    "profiler": {"pipeline", "runtime", "testbed"},
    "trainer": {"pipeline"},
    "controller": {"pipeline", "trainer"},
    "online": {"pipeline", "runtime", "trainer", "controller"},
    "serve": {"pipeline", "runtime", "trainer", "controller"},
    "simulate": {"pipeline", "trainer", "controller", "serve"},
    "cli": {"pipeline", "runtime", "testbed", "features", "profiler", "trainer", "controller", "online", "serve",
            "simulate"},
}
#: where a function may import a project module (the CLI defers its stages for ``ctrl --help``)
LOCAL_IMPORTS_ALLOWED = {"cli"}
#: the train configs are read by ``ctrl --help`` (the options' help lives on their fields): what
#: they need only to validate or resume a run, which loads torch, is imported when it is used
DEFERRED_FOR_HELP = {("trainer.config", "trainer.runs"),
                     ("online.train_options", "trainer.runs")}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every package in ALLOWED."""
    modules = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported project module, inside a function) for every import statement of a file."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                # ``from pkg import mod`` depends on pkg.mod where that is a module, on pkg for a name
                # (a package's parent always runs first: that is not a dependency of the importer)
                submodules = [f"{child.module}.{a.name}" for a in child.names if f"{child.module}.{a.name}" in modules]
                names = submodules + ([child.module] if len(submodules) < len(child.names) else [])
            else:
                visit(child, nested)
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name:
                    found.append((name, in_function))

    visit(ast.parse(path.read_text()), False)
    return found


def package_of(module: str) -> str:
    return module.split(".")[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, bool]]]:
    modules = project_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def test_packages_import_only_downward(graph):
    upward = sorted(f"{module} imports {target}" for module, targets in graph.items() for target, _ in targets
                    if package_of(target) != package_of(module)
                    and package_of(target) not in ALLOWED[package_of(module)])
    assert upward == []


def test_no_import_cycles(graph):
    # Tarjan's strongly connected components over the module graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _ in graph[node]:
            if target == node:
                continue
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    assert cycles == []


def test_package_graph_has_no_cycles(graph):
    edges = {(package_of(m), package_of(t)) for m, targets in graph.items() for t, _ in targets
             if package_of(m) != package_of(t)}
    assert not [(a, b) for a, b in edges if (b, a) in edges]


def test_functions_import_project_modules_only_in_the_cli(graph):
    local = sorted(f"{module} imports {target} inside a function" for module, targets in graph.items()
                   for target, in_function in targets
                   if in_function and package_of(module) not in LOCAL_IMPORTS_ALLOWED
                   and (module, target) not in DEFERRED_FOR_HELP)
    assert local == []


@pytest.mark.parametrize("package", ["pipeline", "trainer", "online", "features", "profiler"])
def test_no_name_a_package_exports_is_also_one_of_its_modules(package):
    """A package's names load on first use; one named like a module would be that module once the
    module is imported."""
    import importlib
    import pkgutil

    imported = importlib.import_module(package)
    assert all(hasattr(imported, name) for name in imported.__all__)
    assert set(imported.__all__) & {m.name for m in pkgutil.iter_modules(imported.__path__)} == set()


def test_ctrl_help_loads_no_torch():
    import subprocess
    import sys

    code = "import sys, cli\ntry:\n    cli.app(['train', '--help'])\nexcept SystemExit:\n    pass\n" \
           "print(sorted(m for m in ('torch', 'duckdb', 'polars') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_no_private_name_is_imported_across_modules():
    """A name one module shares with another is public: ``from pkg.mod import _name`` of a project
    module appears in no project module, benchmark or data script."""
    modules = project_modules()
    scripts = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "data").glob("*.py"))
    found = []
    for path in [*modules.values(), *scripts]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and package_of(node.module) in ALLOWED:
                found += [f"{path.relative_to(ROOT)}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_")]
    assert found == []


def test_the_checker_sees_imports_of_every_kind(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("import pipeline.knobs\nfrom trainer import runs\nfrom runtime.base import ModelRuntime\n"
                      "if True:\n    from online import train\n"
                      "def f():\n    from features.extract import FeatureConfig\n")
    modules = project_modules()
    found = imports_of(source, modules)
    assert ("pipeline.knobs", False) in found and ("trainer.runs", False) in found
    assert ("runtime.base", False) in found and ("online.train", False) in found
    assert ("features.extract", True) in found


def test_code_holds_no_history():
    """Dates and issue numbers belong in docs/ (decisions.md, results.md), not in code or docstrings."""
    found = []
    scripts = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "data").glob("*.py"))
    for path in [*project_modules().values(), *scripts]:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"\b20\d\d-\d\d-\d\d\b|\bissue #?\d+", line, flags=re.IGNORECASE):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
