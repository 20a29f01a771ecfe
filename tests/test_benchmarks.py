"""The benchmarks measure the checkout they are in, not a copy of the package installed earlier."""

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "checkout.py")


def _imports(tree: ast.Module):
    """(line, module) of every import in the file, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_that_runs_the_package_imports_checkout_before_it(script):
    imports = list(_imports(ast.parse(script.read_text())))
    package = [line for line, module in imports if module.split(".")[0] == "elasticdl_strategy"]
    if not package:
        return
    checkout = [line for line, module in imports if module in ("checkout", "benchmarks.checkout")]
    assert checkout, f"{script.name} imports elasticdl_strategy but not benchmarks/checkout.py"
    assert min(checkout) < min(package), f"{script.name} imports elasticdl_strategy before checkout"
