"""Benchmarks measure the checkout they are in: its ``elasticdl_strategy``, not a copy installed elsewhere.

Imported first by every benchmark that runs the package: puts the repository root first on
``sys.path`` and in ``PYTHONPATH``, which the processes a benchmark starts inherit (its workers,
``python -m elasticdl_strategy run`` and the workers that starts). Without it a script run as
``python3 benchmarks/x.py`` imports whatever ``pip install`` put in site-packages last.
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[:1] != [REPO_ROOT]:
    sys.path.insert(0, REPO_ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
