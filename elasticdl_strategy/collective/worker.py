"""Joining a job: peer server, registration, membership, heartbeats, communicator."""

from __future__ import annotations

import logging
from typing import Optional

from elasticdl_strategy.collective.communicator import Communicator
from elasticdl_strategy.collective.p2p import PointToPoint
from elasticdl_strategy.coordinator.client import CoordinatorClient
from elasticdl_strategy.coordinator.membership import Member, Membership
from elasticdl_strategy.environment import WorkerEnvironment
from elasticdl_strategy.transport.allocator import tune_for_streaming
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.worker_server import WorkerServer

logger = logging.getLogger(__name__)


class Worker:
    """This process's place in the job: its server, coordinator session and communicator.

    ``Worker.join(env)`` blocks until the coordinator publishes a membership
    that includes this worker (or raises RendezvousTimeoutError);
    ``Worker.single()`` is a job of one, with no server and no coordinator.
    """

    def __init__(
        self,
        membership: Membership,
        worker_id: str,
        communicator: Communicator,
        server: Optional[WorkerServer] = None,
        client: Optional[CoordinatorClient] = None,
    ):
        self.membership = membership
        self.worker_id = worker_id
        self.communicator = communicator
        self._server = server
        self._client = client
        self._declared_dead = False

    @classmethod
    def single(cls, options: Optional[TransportOptions] = None) -> "Worker":
        options = options or TransportOptions()
        membership = Membership(1, (Member("local", "local"),), "single worker")
        p2p = PointToPoint(0, membership.addresses, membership.version, token="", options=options, worker_id="local")
        return cls(membership, "local", Communicator(p2p))

    @classmethod
    def join(cls, env: WorkerEnvironment) -> "Worker":
        tune_for_streaming()
        server = WorkerServer(f"{env.bind_host}:0", env.token, env.transport)
        client = None
        worker: Optional[Worker] = None
        try:
            address = f"{env.peer_host}:{server.port}"
            client = CoordinatorClient(env.coordinator_address, env.worker_id, env.token, env.transport)
            client.register(address, timeout=env.rendezvous_timeout_s)
            # Heartbeat while waiting too, or a long rendezvous would look like a dead worker.
            client.start_heartbeats(
                lambda: worker.membership.version if worker else 0,
                lambda response: worker._on_heartbeat(response) if worker else None,
            )
            membership = client.wait_for_membership(after_version=0, timeout=env.rendezvous_timeout_s)
            rank = membership.rank_of(env.worker_id)
            p2p = PointToPoint(
                rank,
                membership.addresses,
                membership.version,
                env.token,
                env.transport,
                worker_id=env.worker_id,
                worker_ids=[m.worker_id for m in membership.members],
            )
            communicator = Communicator(p2p)
            server.set_listener(membership.version, p2p)
        except BaseException:
            if client is not None:
                client.leave("failed to join")
                client.close()
            server.stop(0)
            raise
        worker = cls(membership, env.worker_id, communicator, server, client)
        logger.info(
            "worker %s is rank %d of %d (membership version %d)",
            env.worker_id,
            rank,
            membership.size,
            membership.version,
        )
        return worker

    def _on_heartbeat(self, response) -> None:
        """Fails collectives at once when the coordinator drops one of our peers."""
        if not response.known and not self._declared_dead:
            self._declared_dead = True
            logger.error(
                "worker %s: the coordinator declared this worker dead (its heartbeats were late); "
                "its peers no longer count on it",
                self.worker_id,
            )
        if response.membership_version == self.membership.version:
            return
        latest = self._client.get_membership()
        current = self.membership
        for rank, member in enumerate(current.members):
            if latest.rank_of(member.worker_id) < 0 and member.worker_id != self.worker_id:
                self.communicator.p2p.peer_failed(
                    rank, f"the coordinator removed it in membership version {latest.version} ({latest.reason})"
                )

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ends streams (so peers see a goodbye, not a failure), leaves the job, stops the server."""
        self.communicator.close(timeout)
        if self._client is not None:
            self._client.leave("shutdown")
            self._client.close()
        if self._server is not None:
            self._server.stop(grace=1.0)
