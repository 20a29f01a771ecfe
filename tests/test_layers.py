"""The package's layers hold in its imports: no module imports a layer above its own, and no import cycles.

Every import counts, also those inside functions and under ``TYPE_CHECKING``:
a lazy import upward is still an upward dependency.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from typing import Dict, List, Optional, Set

import elasticdl_strategy

# Bottom-up; a module may import its own layer and those below. "" is the package itself.
LAYERS = (
    ("errors", "logs"),
    ("transport",),
    ("collective",),
    ("coordinator",),
    ("environment", "runtime"),
    ("strategy",),
    ("data", "elastic"),
    ("launcher",),
    ("cli", "__main__", ""),
)
PACKAGE = "elasticdl_strategy"
ROOT = pathlib.Path(elasticdl_strategy.__file__).parent


def _modules() -> Dict[str, pathlib.Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: pathlib.Path, modules: Dict[str, pathlib.Path]) -> Set[str]:
    """The package's modules that ``name`` imports (``from p import m`` counts as importing ``p.m`` if a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for level, names in enumerate(LAYERS):
        if top in names:
            return level
    raise AssertionError(f"{module} belongs to no layer: add {top!r} to LAYERS in {__file__}")


def _cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: Dict[str, str] = {}
    stack: List[str] = []

    def visit(module: str) -> Optional[List[str]]:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in sorted(_graph().items())
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert upward == []


def test_the_package_has_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_checks_see_an_upward_import_and_a_cycle():
    graph = {f"{PACKAGE}.collective.ring": {f"{PACKAGE}.runtime"}, f"{PACKAGE}.runtime": {f"{PACKAGE}.collective.ring"}}
    assert _layer(f"{PACKAGE}.runtime") > _layer(f"{PACKAGE}.collective.ring")
    assert _cycle(graph) == [f"{PACKAGE}.collective.ring", f"{PACKAGE}.runtime", f"{PACKAGE}.collective.ring"]
    assert f"{PACKAGE}.runtime.worker" in _graph()[f"{PACKAGE}.runtime"]


def test_importing_the_collective_layer_loads_neither_the_coordinator_nor_the_runtime():
    code = (
        "import sys, elasticdl_strategy.collective.ring, elasticdl_strategy.collective;"
        "above = ('elasticdl_strategy.coordinator', 'elasticdl_strategy.runtime');"
        "print(sorted(m for m in sys.modules if m.startswith(above)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"
