"""Worker of tests/transport/test_rogue_client.py: all-reduces in blocks and checks every result.

argv: OUT_DIR BLOCKS ROUNDS. Writes ``{OUT_DIR}/ports-rank{r}.json`` (its peer and data-socket
ports, for the attacker) once it joined; then for each block b waits for ``{OUT_DIR}/go-{b}``
(the test sets the attack on or off between blocks), runs ROUNDS rounds and writes
``{OUT_DIR}/done-{b}-rank{r}``; at the end it writes ``{OUT_DIR}/rank{r}.json``: whether every
result was exact, the membership version, how long each block took and the peers its
streams reach over a data socket and through shared memory. It leaves once
``{OUT_DIR}/stop`` exists.
"""

import json
import os
import sys
import time

import numpy as np

from elasticdl_strategy import runtime
from tests.workers.report import write_report

out_dir, blocks, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runtime.init()
rank, size = runtime.rank(), runtime.size()
server = runtime.current_worker()._server
ports = {"peer": server.port, "data": server.data_sockets.port if server.data_sockets else None}
with open(os.path.join(out_dir, f".ports-rank{rank}.tmp"), "w") as f:
    json.dump(ports, f)
os.replace(os.path.join(out_dir, f".ports-rank{rank}.tmp"), os.path.join(out_dir, f"ports-rank{rank}.json"))


def wait_for(name: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out_dir, name)) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling for the test's signal


big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: on the data socket
exact, seconds = True, []
for block in range(blocks):
    wait_for(f"go-{block}")
    started = time.monotonic()
    for i in range(rounds):
        total = runtime.allreduce(big * (rank + 1))
        exact &= bool(np.array_equal(total, big * (size * (size + 1) // 2)))
        small = runtime.allreduce(np.array([i, rank], np.int64))
        exact &= bool(small[0] == i * size and small[1] == size * (size - 1) // 2)
    seconds.append(time.monotonic() - started)
    open(os.path.join(out_dir, f"done-{block}-rank{rank}"), "w").close()
p2p = runtime.communicator().p2p
report = {
    "exact": exact,
    "version": runtime.current_worker().membership.version,
    "seconds": seconds,
    "data_socket_peers": p2p.data_socket_peers,
    "shared_memory_peers": p2p.shared_memory_peers,
}
write_report(out_dir, rank, report)
wait_for("stop")  # the servers stay up until the test's attack is over
runtime.shutdown()
