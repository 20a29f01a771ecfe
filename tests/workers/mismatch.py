"""Worker of test_failures.py: the last rank calls all-reduce with another shape."""

import json
import os
import sys

import numpy as np

from elasticdl_strategy import collective, errors


def main(results_dir: str) -> None:
    collective.init()
    rank, n = collective.rank(), collective.size()
    shape = (5,) if rank == n - 1 else (4,)
    outcome = {"rank": rank}
    try:
        collective.allreduce(np.ones(shape, np.float32))
        outcome["error"] = None
    except errors.ElasticDLError as e:
        outcome.update(error=type(e).__name__, ranks=list(getattr(e, "ranks", [])), message=str(e))
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


if __name__ == "__main__":
    main(sys.argv[1])
