"""The examples in the package's docstrings that run on their own (``>>>``) give what they show.

Examples that need a running job stay ``Example::`` blocks; the job's own tests cover them.
"""

import doctest
import importlib
import pkgutil

import pytest

import elasticdl_strategy

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(elasticdl_strategy.__path__, "elasticdl_strategy.")
    if ".protos." not in info.name and not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (see above)"


def test_the_standalone_examples_are_found():
    attempted = sum(doctest.testmod(importlib.import_module(n), verbose=False).attempted for n in MODULES)
    assert attempted >= 10, attempted  # a count that drops means examples stopped being collected
