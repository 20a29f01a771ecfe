"""Worker of test_failures.py: the last rank SIGKILLs (or SIGSTOPs) itself during a stream of all-reduces
(``kill-large``: SIGKILL with 2 GiB resident, whose teardown keeps its sockets open ~0.1 s longer;
``kill-in-place``: all-reduces of 4 MiB and 4 KiB (more than a slot at N = 4), which ranks of one
host read where they lie; ``kill-pieces``:
8 MiB in three pieces, ``Communicator.allreduce_pieces``, read piece by piece).

Survivors write ``{results_dir}/rank{r}.json`` with the error they got and when.
"""

import json
import os
import signal
import sys
import time

import numpy as np

from elasticdl_strategy import errors, runtime
from tests.workers.report import write_report


def _allreduce_pieces(flat: np.ndarray) -> np.ndarray:
    """``flat``'s elements as three pieces (gaps between them) all-reduced into a new array."""
    third = flat.size // 3
    pieces = [flat[:third], flat[third : 2 * third], flat[2 * third :]]
    out = np.empty(flat.size + 32, flat.dtype)
    return runtime.communicator().allreduce_pieces(pieces, [0, third + 16, 2 * third + 32], out)


def main(results_dir: str, how: str) -> None:
    runtime.init()
    rank, n = runtime.rank(), runtime.size()
    victim = n - 1
    elements = {"kill-in-place": (1 << 20) + 1024, "kill-pieces": 1 << 21}.get(how, 1 << 16)
    allreduce = _allreduce_pieces if how == "kill-pieces" else runtime.allreduce
    runtime.barrier()
    if rank == victim:
        for _ in range(20):
            allreduce(np.ones(elements, np.float32))
        ballast = np.ones(2 << 30, np.uint8) if how == "kill-large" else None  # noqa: F841 - resident until the kill
        with open(os.path.join(results_dir, "victim.json"), "w") as f:
            json.dump({"rank": rank, "killed_at": time.time()}, f)
        # SIGSTOP: a hung peer whose sockets stay open; only missed heartbeats reveal it.
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    outcome = {"rank": rank, "error": None}
    try:
        for _ in range(100_000):
            allreduce(np.ones(elements, np.float32))
    except errors.ElasticDLError as e:
        outcome.update(error=type(e).__name__, at=time.time(), peer_rank=getattr(e, "peer_rank", None), message=str(e))
    outcome["shared_memory_peers"] = runtime.communicator().p2p.shared_memory_peers
    outcome["data_socket_peers"] = runtime.communicator().p2p.data_socket_peers
    segment = runtime.communicator()._host_segment
    outcome["single_copy"] = segment is not None and segment.single_copy
    outcome["reads_pieces"] = runtime.communicator().reads_pieces(4 * elements + 128, 3)
    outcome["beyond_a_slot"] = segment is not None and 4 * elements > segment.slot_bytes
    write_report(results_dir, rank, outcome)
    sys.exit(3 if outcome["error"] else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "kill")
