"""Test helpers: N ranks in one process (real gRPC servers and streams, one thread per rank)."""

from __future__ import annotations

from concurrent import futures
from typing import Callable, List, Optional, Sequence, Union

from elasticdl_strategy.collective.communicator import Communicator
from elasticdl_strategy.collective.p2p import PointToPoint
from elasticdl_strategy.transport.auth import new_token
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.worker_server import WorkerServer

# Every thread of a test run finishes well within this, or the test fails.
RUN_TIMEOUT_S = 60.0


def transport_options(transport: str, **kwargs) -> TransportOptions:
    """Test options whose payloads go through ``transport``: "host-segment" (shared memory, small
    all-reduces in a host segment: the default on one host), "shared-memory" (arenas and lanes
    only), "data-socket" or "grpc"."""
    assert transport in ("host-segment", "shared-memory", "data-socket", "grpc"), transport
    kwargs.setdefault("timeout_s", 20.0)
    kwargs.setdefault("connect_timeout_s", 5.0)
    if transport != "host-segment":
        kwargs.setdefault("host_segment_bytes", 0)
    shared_memory = transport in ("host-segment", "shared-memory")
    return TransportOptions(shared_memory=shared_memory, data_socket=transport != "grpc", **kwargs)


class ThreadCluster:
    """``n`` communicators in this process, each with its own peer server; ``options``
    may be one per rank (e.g. ranks that cannot see each other's shared memory), and
    ``hosts`` the host each rank stands for (all ranks share this one by default).

    Example::

        with ThreadCluster(3) as cluster:
            results = cluster.run(lambda comm: comm.allreduce(np.ones(4)))
    """

    def __init__(
        self,
        n: int,
        options: Union[None, TransportOptions, Sequence[TransportOptions]] = None,
        token: Optional[str] = None,
        hosts: Optional[Sequence[str]] = None,
    ):
        self.token = token or new_token()
        options = options or TransportOptions(timeout_s=20.0, connect_timeout_s=5.0)
        per_rank = list(options) if isinstance(options, (list, tuple)) else [options] * n
        self.servers = [WorkerServer("127.0.0.1:0", self.token, o) for o in per_rank]
        self.addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        self.communicators: List[Communicator] = []
        for rank, server in enumerate(self.servers):
            p2p = PointToPoint(
                rank, self.addresses, 1, self.token, per_rank[rank], worker_id=f"w{rank}",
                worker_ids=[f"w{i}" for i in range(n)],
            )  # fmt: skip
            server.set_listener(1, p2p)
            self.communicators.append(Communicator(p2p, hosts=hosts))
        self._pool = futures.ThreadPoolExecutor(max_workers=n)

    @property
    def size(self) -> int:
        return len(self.communicators)

    def run(self, fn: Callable[[Communicator], object], timeout: float = RUN_TIMEOUT_S) -> List[object]:
        """Runs ``fn(comm)`` on every rank at once; returns results by rank, or raises the first error."""
        tasks = [self._pool.submit(fn, comm) for comm in self.communicators]
        return [task.result(timeout=timeout) for task in tasks]

    def run_outcomes(self, fn: Callable[[Communicator], object], timeout: float = RUN_TIMEOUT_S) -> List[object]:
        """Like :meth:`run`, but returns each rank's exception instead of raising it."""
        tasks = [self._pool.submit(fn, comm) for comm in self.communicators]
        futures.wait(tasks, timeout=timeout)
        outcomes = []
        for task in tasks:
            if not task.done():
                raise AssertionError(f"a rank did not finish within {timeout}s")
            outcomes.append(task.exception() if task.exception() is not None else task.result())
        return outcomes

    def close(self) -> None:
        try:
            for comm in self.communicators:
                comm.close(timeout=2.0)
        finally:
            for server in self.servers:
                server.stop(grace=0.2)
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ThreadCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
