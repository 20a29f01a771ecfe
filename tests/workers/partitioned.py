"""Worker of test_partition.py: all-reduces until one fails (the network between the hosts is cut).

Writes ``{results_dir}/{worker_id}.started`` after its first all-reduces, then
``{results_dir}/{worker_id}.json`` with the error it got and when.
"""

import os
import sys

import numpy as np

from elasticdl_strategy import runtime
from tests.workers.until_failure import all_reduce_until_it_fails


def main(results_dir: str) -> None:
    runtime.init()
    worker_id = os.environ["EDL_WORKER_ID"]
    array = np.ones(1 << 20, np.float32)  # 4 MiB: the ring, payloads on the data path under test
    for _ in range(5):
        runtime.allreduce(array)
    p2p = runtime.communicator().p2p
    outcome = {"rank": runtime.rank(), "data_socket_peers": p2p.data_socket_peers}
    open(os.path.join(results_dir, f"{worker_id}.started"), "w").close()
    all_reduce_until_it_fails(results_dir, worker_id, array, outcome)


if __name__ == "__main__":
    main(sys.argv[1])
