"""Worker of test_shared_memory.py: a 20 MiB all-reduce between two ranks (of this process) whose
shared-memory directory, argv[1], is far too small for their arenas; prints the sums and what went
through the slots. Dies of SIGBUS where an arena writes into memory the directory could not give."""

import sys

import numpy as np

from tests.cluster import ThreadCluster, transport_options

options = transport_options("shared-memory", shared_memory_dir=sys.argv[1])  # lanes (16 MiB) and slots (32 MiB)
inputs = [np.full(5 << 20, rank + 1, np.float32) for rank in range(2)]
with ThreadCluster(2, options) as cluster:
    results = cluster.run(lambda comm: comm.allreduce(inputs[comm.rank].copy(), op="sum"))
    assert all(np.array_equal(r, inputs[0] + inputs[1]) for r in results)
    print("sums ok; bytes through slots:", sum(c.p2p.shared_bytes_sent for c in cluster.communicators), flush=True)
