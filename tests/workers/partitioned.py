"""Worker of test_partition.py: all-reduces until one fails (the network between the hosts is cut).

Writes ``{results_dir}/{worker_id}.started`` after its first all-reduces, then
``{results_dir}/{worker_id}.json`` with the error it got and when.
"""

import os
import sys
import time

import numpy as np

from elasticdl_strategy import errors, runtime
from tests.workers.report import write_named_report


def main(results_dir: str) -> None:
    runtime.init()
    worker_id = os.environ["EDL_WORKER_ID"]
    array = np.ones(1 << 20, np.float32)  # 4 MiB: the ring, payloads on the data path under test
    for _ in range(5):
        runtime.allreduce(array)
    p2p = runtime.communicator().p2p
    outcome = {"rank": runtime.rank(), "data_socket_peers": p2p.data_socket_peers, "error": None}
    open(os.path.join(results_dir, f"{worker_id}.started"), "w").close()
    try:
        for _ in range(1_000_000):
            runtime.allreduce(array)
    except errors.ElasticDLError as e:
        outcome.update(error=type(e).__name__, at=time.time(), message=str(e))
    write_named_report(results_dir, worker_id, outcome)
    runtime.shutdown()  # must not hang on threads blocked on the cut connections
    sys.exit(3 if outcome["error"] else 0)


if __name__ == "__main__":
    main(sys.argv[1])
