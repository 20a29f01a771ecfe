"""One error hierarchy: every exception the package defines derives from ElasticDLError, and errors.py's tree is it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from typing import Dict, Optional

import elasticdl_strategy
from elasticdl_strategy import errors


def _exception_classes() -> Dict[str, type]:
    """Every exception class defined in the package, by name (protobuf modules have none)."""
    found: Dict[str, type] = {}
    for info in pkgutil.walk_packages(elasticdl_strategy.__path__, "elasticdl_strategy."):
        if info.name.endswith(("_pb2", "_pb2_grpc", "__main__")):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[name] = obj
    found.update(
        (name, obj) for name, obj in vars(errors).items() if inspect.isclass(obj) and issubclass(obj, Exception)
    )
    return found


def _documented_tree() -> Dict[str, Optional[str]]:
    """``{class name: parent name}`` from the box-drawn tree in errors.py's docstring."""
    doc = errors.__doc__ or ""
    lines = doc.split("The hierarchy")[1].split("::", 1)[1].strip("\n").split("\n\n")[0].splitlines()
    parents: Dict[str, Optional[str]] = {}
    open_at_depth: Dict[int, str] = {}
    for line in lines:
        match = re.match(r"^ {4}((?:[│ ] {3})*)(?:[├└]── )?(\w+)", line)
        assert match, f"not a line of the tree: {line!r}"
        depth = len(match.group(1)) // 4 + (1 if "──" in line else 0)
        name = match.group(2)
        parents[name] = open_at_depth.get(depth - 1)
        open_at_depth[depth] = name
    return parents


def test_every_exception_the_package_defines_derives_from_elasticdl_error():
    outside = sorted(name for name, cls in _exception_classes().items() if not issubclass(cls, errors.ElasticDLError))
    assert outside == []


def test_the_documented_tree_is_the_hierarchy_of_every_public_error():
    public = {name: cls for name, cls in _exception_classes().items() if not name.startswith("_")}
    actual = {
        name: next((base.__name__ for base in cls.__bases__ if issubclass(base, errors.ElasticDLError)), None)
        for name, cls in public.items()
    }
    assert _documented_tree() == actual


def test_the_tree_reader_sees_nesting():
    tree = _documented_tree()
    assert tree["ElasticDLError"] is None
    assert tree["RendezvousTimeoutError"] == "RendezvousError"
    assert tree["MembershipChangedInterrupt"] == "ElasticDLError"


def test_worker_left_uncaught_ends_the_process_with_code_0_and_says_nothing():
    import subprocess
    import sys

    from elasticdl_strategy.errors import ElasticDLError, WorkerLeft

    left = WorkerLeft("left the job gracefully at commit #3")
    assert isinstance(left, ElasticDLError) and isinstance(left, SystemExit)
    assert (str(left), left.code) == ("left the job gracefully at commit #3", 0)
    script = "from elasticdl_strategy.errors import WorkerLeft\nraise WorkerLeft('left the job')"
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (ended.returncode, ended.stderr) == (0, "")
