"""Worker of tests/transport/test_rogue_client.py: all-reduces for a while and checks every result.

argv: OUT_DIR ROUNDS. Writes ``{OUT_DIR}/ports-rank{r}.json`` (its peer and data-socket ports,
for the attacker) once it joined, waits for ``{OUT_DIR}/go``, runs the rounds, then writes
``{OUT_DIR}/rank{r}.json``: whether every result was exact, the membership version at the
end, and how long the rounds took; it leaves once ``{OUT_DIR}/stop`` exists.
"""

import json
import os
import sys
import time

import numpy as np

from elasticdl_strategy import collective
from tests.workers.report import write_report

out_dir, rounds = sys.argv[1], int(sys.argv[2])
collective.init()
rank, size = collective.rank(), collective.size()
server = collective.current_worker()._server
ports = {"peer": server.port, "data": server.data_sockets.port if server.data_sockets else None}
with open(os.path.join(out_dir, f".ports-rank{rank}.tmp"), "w") as f:
    json.dump(ports, f)
os.replace(os.path.join(out_dir, f".ports-rank{rank}.tmp"), os.path.join(out_dir, f"ports-rank{rank}.json"))

go = os.path.join(out_dir, "go")  # written by the test once its attack is under way
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)  # polling for the test's go-ahead
big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: on the data socket
exact, started = True, time.monotonic()
for i in range(rounds):
    total = collective.allreduce(big * (rank + 1))
    exact &= bool(np.array_equal(total, big * (size * (size + 1) // 2)))
    small = collective.allreduce(np.array([i, rank], np.int64))
    exact &= bool(small[0] == i * size and small[1] == size * (size - 1) // 2)
elapsed = time.monotonic() - started
report = {"exact": exact, "version": collective.current_worker().membership.version, "seconds": elapsed}
write_report(out_dir, rank, report)
stop = os.path.join(out_dir, "stop")  # the servers stay up until the test's attack is over
deadline = time.monotonic() + 120
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.05)  # polling for the test's signal
collective.shutdown()
