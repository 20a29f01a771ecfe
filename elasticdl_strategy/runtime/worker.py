"""Joining a job: peer server, registration, membership, heartbeats, communicator.

The :class:`Worker` also re-forms: after a failure or a membership switch at a
commit, :meth:`Worker.reform` waits for the coordinator's next membership and
replaces the communicator in place (same process, same server).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Callable, Iterable, Optional, Set, Tuple

from elasticdl_strategy.collective.communicator import Communicator
from elasticdl_strategy.collective.p2p import PointToPoint
from elasticdl_strategy.coordinator.client import CoordinatorClient
from elasticdl_strategy.coordinator.membership import Member, Membership
from elasticdl_strategy.environment import WorkerEnvironment
from elasticdl_strategy.errors import WorkerLeft
from elasticdl_strategy.transport.allocator import tune_for_streaming
from elasticdl_strategy.transport.health import answers_health_check
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2
from elasticdl_strategy.transport.worker_server import WorkerServer

logger = logging.getLogger(__name__)


class ElasticLoop(enum.Enum):
    """Where a worker stands with :func:`elasticdl_strategy.elastic.run`."""

    NONE = "not in an elastic loop"
    RUNNING = "in an elastic loop"
    RETURNED = "its elastic loop returned"


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
        env: Optional[WorkerEnvironment] = None,
        joined_running_job: bool = False,
    ):
        self.membership = membership
        self.worker_id = worker_id
        self.communicator = communicator
        # True when this worker joined a job that was already training: its state
        # comes from the others (elastic sync), not from broadcasts at creation.
        self.joined_running_job = joined_running_job
        # The last commit the job recorded, as this worker knows it (record_commit).
        self.last_commit = coordinator_pb2.CommitRecord()
        self._server = server
        self._client = client
        self._env = env
        self._reregister_lock = threading.Lock()
        self._declared_dead = False
        self._replaced = False
        # Set when this worker asked to leave (request_leave, shutdown): the coordinator forgetting it
        # is then expected.
        self.leaving = False
        # Moved by elastic.run (enter_elastic_loop, elastic_loop_returned). In an elastic loop the
        # coordinator's membership decides (else only the transport's proof does), and an exit while it
        # runs does not mean the job finished.
        self.elastic_loop = ElasticLoop.NONE
        self._kept_peers: Set[Tuple[int, str]] = set()  # (membership version, worker id): dropped, alive

    def enter_elastic_loop(self) -> None:
        """Called by ``elastic.run`` on entry: from now on the coordinator's membership decides."""
        self.elastic_loop = ElasticLoop.RUNNING

    def elastic_loop_returned(self) -> None:
        """Called by ``elastic.run`` when the training function returned: an exit now ends the job."""
        self.elastic_loop = ElasticLoop.RETURNED

    def request_leave(self) -> None:
        """This worker leaves at the commit it sends next: the coordinator dropping it is expected."""
        self.leaving = True

    def record_commit(self, record: coordinator_pb2.CommitRecord) -> None:
        """The coordinator recorded ``record``: the commit a re-registration after its restart reports."""
        self.last_commit = record

    @property
    def elastic(self) -> bool:
        """Whether an elastic loop runs (or ran) here: the coordinator's membership decides."""
        return self.elastic_loop is not ElasticLoop.NONE

    @classmethod
    def single(cls, options: Optional[TransportOptions] = None) -> "Worker":
        options = options or TransportOptions()
        membership = Membership(1, (Member("local", "local"),), "single worker")
        p2p = PointToPoint(0, membership.addresses, membership.version, token="", options=options, worker_id="local")
        return cls(membership, "local", Communicator(p2p))

    @classmethod
    def join(cls, env: WorkerEnvironment) -> "Worker":
        """Registers, waits for a membership with this worker and connects to it.

        Raises:
            RendezvousError, RendezvousTimeoutError, AuthenticationError, JobFinished,
                WorkerReplaced: see :class:`Registration`.
        """
        return Registration(env).admit()

    @property
    def client(self) -> Optional[CoordinatorClient]:
        """The coordinator session (``None`` for a single worker)."""
        return self._client

    def _in_job(self) -> Tuple[CoordinatorClient, WorkerServer, WorkerEnvironment]:
        """The coordinator session, server and environment of a worker that joined a job."""
        if self._client is None or self._server is None or self._env is None:
            raise RuntimeError("a single worker has no coordinator to talk to")
        return self._client, self._server, self._env

    def _stop_as_replaced(self) -> None:
        """A new process took this worker's id: fail its collectives; its next wait for a membership
        raises WorkerReplaced."""
        if self._replaced:
            return
        self._replaced = True
        logger.error(
            "a new process registered under this worker id (this one was restarted or relaunched "
            "while it hung): this process stops"
        )
        self._fail_peers(f"worker {self.worker_id} was replaced by a new process under its id")

    def reregister(self) -> None:
        """Registers again with the membership and last commit this worker knows.

        Used when the coordinator no longer knows this worker: after a
        coordinator restart it recovers the job from these reports; after this
        worker was declared dead, it joins again as a new member.
        """
        if self._client is None:
            return
        client, server, env = self._in_job()
        with self._reregister_lock:
            client.register(
                f"{env.peer_host}:{server.port}", env.rendezvous_timeout_s, self.membership, self.last_commit
            )

    def _on_heartbeat(self, response) -> None:
        """Fails collectives at once when the coordinator drops one of our peers (or replaced this worker)."""
        if response.replaced:
            self._stop_as_replaced()
            return
        if not response.known:
            if self.leaving:
                return
            if response.membership_version < self.membership.version:
                logger.warning(
                    "the coordinator is at membership version %d, behind this worker's %d "
                    "(it restarted): registering again so that it recovers the job",
                    response.membership_version,
                    self.membership.version,
                )
            elif response.membership_version == self.membership.version:
                logger.info("the restarted coordinator asks for this worker's view of the job")
            elif not self._declared_dead:
                self._declared_dead = True
                logger.error(
                    "the coordinator declared this worker dead (its heartbeats were late); "
                    "its peers no longer count on it: it registers again and waits to rejoin"
                )
                if self.elastic:  # converge on the coordinator's view now, not at the next commit
                    self._fail_peers("the coordinator declared this worker dead (its heartbeats were late)")
            self.reregister()
            return
        self._declared_dead = False
        current, communicator = self.membership, self.communicator
        if response.membership_version == current.version:
            return
        if communicator.p2p.membership_version != current.version:
            return  # a re-formation is swapping them right now; the next heartbeat looks again
        latest = self._in_job()[0].get_membership()
        for rank, member in enumerate(current.members):
            if latest.rank_of(member.worker_id) < 0 and member.worker_id != self.worker_id:
                reason = f"the coordinator removed it in membership version {latest.version} ({latest.reason})"
                if not self.elastic and self._still_alive(latest.version, member, reason):
                    continue
                communicator.p2p.peer_failed(rank, reason)

    def _still_alive(self, version: int, member: Member, reason: str) -> bool:
        """For a job that is not elastic: whether a peer the coordinator removed answers a health
        check (asked once per membership version). Such a job cannot re-form, so it fails a peer
        only on proof that it is gone (this, or its connection breaking)."""
        key = (version, member.worker_id)
        if key in self._kept_peers:
            return True
        if not answers_health_check(member.address, self._in_job()[2].transport):
            return False
        self._kept_peers.add(key)
        logger.warning(
            "%s: but %s answers its health check; this job is not elastic, so it trains on with it",
            reason,
            member.worker_id,
        )
        return True

    def _fail_peers(self, reason: str) -> None:
        p2p = self.communicator.p2p
        for rank in range(p2p.size):
            if rank != p2p.rank:
                p2p.peer_failed(rank, reason)

    def reform(
        self,
        reason: str,
        failed: bool,
        suspects: Iterable[str] = (),
        timeout: Optional[float] = None,
        stop: Optional[Callable[[], bool]] = None,
    ) -> Optional[float]:
        """Replaces the communicator with one for the coordinator's next membership.

        Args:
            reason: why (logged with the change).
            failed: a collective failed: report it (and ``suspects``, worker ids
                that could not be reached) so that the coordinator publishes a
                new membership. Without failure the caller knows one was
                published (a switch agreed at a commit).
            timeout: how long to wait for a membership with at least
                ``--min-workers`` (default: the rendezvous timeout).
            stop: gives up waiting when it returns true (the worker was asked
                to leave while too few workers remain); checked at the start and
                whenever ``client.interrupt_wait()`` is called.

        Returns:
            seconds the re-formation took, or ``None`` when ``stop`` ended the
            wait (the old communicator stays, aborted).

        Raises:
            RendezvousTimeoutError: no usable membership within ``timeout``; the
                message says how many workers are registered and how many are needed.
        """
        client, server, env = self._in_job()
        started = time.monotonic()
        old = self.membership
        if failed:
            suspects = list(suspects)
            p2p = self.communicator.p2p
            dead = [p2p.worker_ids[r] for r in sorted(p2p.dead) if p2p.worker_ids[r] in suspects]
            client.report_failure(old.version, suspects, reason, dead)
        timeout = env.rendezvous_timeout_s if timeout is None else timeout
        new = client.wait_for_membership(after_version=old.version, timeout=timeout, stop=stop)
        if new is None:
            return None
        previous = self.communicator
        self.communicator = _communicator_for(new, self.worker_id, env, server)
        self.membership = new
        # Goodbyes to the old peers in the background: a hung peer must not delay training.
        threading.Thread(target=previous.close, kwargs={"timeout": 2.0}, name="edl-close-old", daemon=True).start()
        elapsed = time.monotonic() - started
        logger.info(
            "membership version %d -> %d (%s; coordinator: %s): %s -> %s; now rank %d of %d (re-formed in %.2fs)",
            old.version,
            new.version,
            reason,
            new.reason,
            [m.worker_id for m in old.members],
            [m.worker_id for m in new.members],
            self.communicator.rank,
            new.size,
            elapsed,
        )
        return elapsed

    def shutdown(self, timeout: float = 5.0, finished: bool = False) -> None:
        """Ends streams (so peers see a goodbye, not a failure), leaves the job, stops the server.

        ``finished``: the program ended successfully, so the job is done and
        standbys can stop waiting.
        """
        self.leaving = True
        self.communicator.close(timeout)
        if self._client is not None:
            self._client.leave("finished" if finished else "shutdown", finished=finished)
            self._client.close()
        if self._server is not None:
            self._server.stop(grace=1.0)


class Registration:
    """A worker registered with the coordinator (its server up, heartbeating), not yet a member.

    :meth:`admit` waits for a membership with it and returns the :class:`Worker`;
    :meth:`interrupt` ends that wait early, from another thread. Example::

        registration = Registration(WorkerEnvironment.from_env(os.environ))
        if registration.joins_running_job:
            ...  # its state will come from the members (elastic sync)
        worker = registration.admit()

    Raises (from the constructor):
        RendezvousError: the coordinator could not be reached in time, or refused the worker.
        AuthenticationError: the coordinator rejected the job token.
    """

    def __init__(self, env: WorkerEnvironment):
        tune_for_streaming()
        self._env = env
        self._server = WorkerServer(
            f"{env.bind_host}:{env.peer_port}", env.token, env.transport, data_port=env.data_port
        )
        self._client: Optional[CoordinatorClient] = None
        self._worker: Optional[Worker] = None
        try:
            self._address = f"{env.peer_host}:{self._server.port}"
            self._client = CoordinatorClient(
                env.coordinator_address, env.worker_id, env.token, env.transport, host=env.host_id
            )
            registered = self._client.register(self._address, timeout=env.rendezvous_timeout_s)
            # True when the job already trains: this worker's state will come from the members.
            self.joins_running_job = registered.joins_running_job
            # Heartbeat while waiting too, or a long rendezvous would look like a dead worker.
            self._client.start_heartbeats(
                lambda: self._worker.membership.version if self._worker else 0, self._on_heartbeat
            )
        except BaseException:
            self._abandon()
            raise

    def _on_heartbeat(self, response) -> None:
        if self._worker is not None:
            self._worker._on_heartbeat(response)
        elif response.replaced:
            pass  # the wait for a membership in admit() raises WorkerReplaced
        elif not response.known and self._client is not None:  # forgotten while waiting (coordinator restart)
            self._client.register(self._address, timeout=self._env.rendezvous_timeout_s)

    def admit(self, stop: Optional[Callable[[], bool]] = None) -> "Worker":
        """Waits for a membership with this worker and connects to its peers.

        ``stop()`` is checked when the wait starts and whenever :meth:`interrupt` is called;
        true gives up the wait. On any failure the worker leaves the job.

        Raises:
            WorkerLeft: ``stop()`` was true before the admission.
            RendezvousTimeoutError: too few workers registered within the rendezvous timeout.
            JobFinished: the job finished while this worker waited (a standby).
            WorkerReplaced: a new process registered under this worker's id.
        """
        assert self._client is not None, "admit() after a failed registration"
        env = self._env
        try:
            membership = self._client.wait_for_membership(after_version=0, timeout=env.rendezvous_timeout_s, stop=stop)
            if membership is None:
                raise WorkerLeft(f"worker {env.worker_id} stopped waiting to be admitted")
            communicator = _communicator_for(membership, env.worker_id, env, self._server)
        except BaseException:
            self._abandon()
            raise
        worker = Worker(
            membership, env.worker_id, communicator, self._server, self._client, env, self.joins_running_job
        )
        self._worker = worker
        logger.info(
            "joined as rank %d of %d (membership version %d)", communicator.rank, membership.size, membership.version
        )
        return worker

    def interrupt(self) -> None:
        """Makes a wait in :meth:`admit` check its ``stop()`` now (make it true first)."""
        if self._client is not None:
            self._client.interrupt_wait()

    def _abandon(self) -> None:
        """Leaves the job and stops the server: this registration ends without a worker."""
        if self._client is not None:
            self._client.leave("failed to join")
            self._client.close()
        self._server.stop(0)


def _communicator_for(
    membership: Membership, worker_id: str, env: WorkerEnvironment, server: WorkerServer
) -> Communicator:
    """This worker's communicator in ``membership``; ``server`` hands it the streams of that version."""
    p2p = PointToPoint(
        membership.rank_of(worker_id),
        membership.addresses,
        membership.version,
        env.token,
        env.transport,
        worker_id=worker_id,
        worker_ids=[m.worker_id for m in membership.members],
    )
    communicator = Communicator(p2p, hosts=membership.hosts)
    server.set_listener(membership.version, p2p)
    return communicator
