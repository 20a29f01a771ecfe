"""Worker of test_hierarchical_hosts.py: large all-reduces between two hosts, two workers on each.

argv: RESULTS_DIR. Writes ``{RESULTS_DIR}/{worker_id}-started.json`` (rank, the bytes it sent
in ``ROUNDS`` all-reduces, whether every result was exact, its shared-memory and data-socket
peers), then all-reduces until one fails (a worker is killed) and writes
``{RESULTS_DIR}/{worker_id}.json`` with the error and when.
"""

import os
import sys

import numpy as np

from elasticdl_strategy import runtime
from tests.workers.report import write_named_report
from tests.workers.until_failure import all_reduce_until_it_fails

ROUNDS = 5


def main(results_dir: str) -> None:
    runtime.init()
    worker_id, rank, size = os.environ["EDL_WORKER_ID"], runtime.rank(), runtime.size()
    array = np.full(1 << 20, rank + 1, np.float32)  # 4 MiB: the ring's size, so the hierarchy's
    p2p = runtime.communicator().p2p
    before, exact = p2p.bytes_sent, True
    for _ in range(ROUNDS):
        exact &= bool(np.all(runtime.allreduce(array) == size * (size + 1) // 2))
    started = {
        "rank": rank,
        "sent": (p2p.bytes_sent - before) // ROUNDS,
        "exact": exact,
        "shared_memory_peers": p2p.shared_memory_peers,
        "data_socket_peers": p2p.data_socket_peers,
    }
    write_named_report(results_dir, f"{worker_id}-started", started)
    all_reduce_until_it_fails(results_dir, worker_id, array, {"rank": rank})


if __name__ == "__main__":
    main(sys.argv[1])
