"""What test workers of a failure end with: all-reduce until a collective fails, report it, exit."""

import sys
import time

import numpy as np

from elasticdl_strategy import errors, runtime
from tests.workers.report import write_named_report


def all_reduce_until_it_fails(results_dir: str, worker_id: str, array: np.ndarray, outcome: dict) -> None:
    """All-reduces ``array`` until a collective fails; writes ``outcome`` with the error's type, message
    and time to ``{results_dir}/{worker_id}.json``; shuts down (which must not hang on threads blocked
    on dead connections) and exits 3 (0 if nothing failed)."""
    outcome["error"] = None
    try:
        for _ in range(1_000_000):
            runtime.allreduce(array)
    except errors.ElasticDLError as e:
        outcome.update(error=type(e).__name__, at=time.time(), message=str(e))
    write_named_report(results_dir, worker_id, outcome)
    runtime.shutdown()
    sys.exit(3 if outcome["error"] else 0)
