"""Worker of test_failures.py: the last rank calls all-reduce with another shape."""

import sys

import numpy as np

from elasticdl_strategy import errors, runtime
from tests.workers.report import write_report


def main(results_dir: str) -> None:
    runtime.init()
    rank, n = runtime.rank(), runtime.size()
    shape = (5,) if rank == n - 1 else (4,)
    outcome = {"rank": rank}
    try:
        runtime.allreduce(np.ones(shape, np.float32))
        outcome["error"] = None
    except errors.ElasticDLError as e:
        outcome.update(error=type(e).__name__, ranks=list(getattr(e, "ranks", [])), message=str(e))
    write_report(results_dir, rank, outcome)


if __name__ == "__main__":
    main(sys.argv[1])
