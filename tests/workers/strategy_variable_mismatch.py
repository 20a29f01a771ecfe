"""Worker of tests/strategy/test_api.py: the last rank creates its variables in another order."""

import sys

import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, errors, runtime
from tests.workers.report import write_report


def main(results_dir: str) -> None:
    strategy = AllReduceStrategy()
    rank, n = runtime.rank(), runtime.size()
    names = ["bias", "kernel"] if rank == n - 1 else ["kernel", "bias"]
    outcome = {"rank": rank, "error": None}
    try:
        with strategy.scope():
            for name in names:
                tf.Variable(tf.zeros([4]), name=name)
    except errors.CollectiveMismatchError as e:
        outcome.update(error=type(e).__name__, message=str(e), ranks=list(e.ranks))
    write_report(results_dir, rank, outcome)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
