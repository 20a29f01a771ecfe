"""The coordinator: rendezvous, membership versions and heartbeats.

One coordinator runs per job, in its own process (the local launcher starts it;
on Kubernetes the master pod runs it). Workers register with a stable worker id
and the address of their peer server; once enough have registered the
coordinator publishes membership version 1, ranks following join order. A
worker whose heartbeats stop for ``heartbeat_timeout_s`` is declared dead, and
every change of the member set publishes a new version.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Dict, List, Optional

import grpc

from elasticdl_strategy.coordinator.membership import EMPTY, Member, Membership
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.protos import coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)

# Longest a GetMembership call may block, so that callers' deadlines stay short.
MAX_MEMBERSHIP_WAIT_S = 30.0


@dataclasses.dataclass(frozen=True)
class CoordinatorParams:
    """How the coordinator forms and keeps the membership.

    Args:
        min_workers: fewest workers to form a membership with.
        max_workers: most workers in a membership; later registrants wait as standbys.
        target_workers: the first membership is formed as soon as this many have
            registered (or, with at least ``min_workers``, ``last_call_s`` after
            the ``min_workers``-th registered).
        heartbeat_interval_s: how often workers heartbeat.
        heartbeat_timeout_s: silence after which a worker is declared dead.
        last_call_s: see ``target_workers``.
    """

    min_workers: int = 1
    max_workers: int = 1
    target_workers: int = 1
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    last_call_s: float = 5.0

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ConfigError(f"min_workers={self.min_workers} must be at least 1")
        if self.max_workers < self.min_workers:
            raise ConfigError(f"max_workers={self.max_workers} is below min_workers={self.min_workers}")
        if not self.min_workers <= self.target_workers <= self.max_workers:
            raise ConfigError(
                f"workers={self.target_workers} must be between min_workers={self.min_workers} "
                f"and max_workers={self.max_workers}"
            )
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ConfigError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be positive and below "
                f"heartbeat_timeout_s={self.heartbeat_timeout_s}"
            )
        if self.last_call_s < 0:
            raise ConfigError(f"last_call_s={self.last_call_s} must not be negative")


@dataclasses.dataclass
class _Worker:
    worker_id: str
    address: str
    join_order: int
    last_heartbeat: float
    alive: bool = True


class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Membership state and the ``Coordinator`` gRPC service.

    Example (in-process, as the tests do)::

        coordinator = Coordinator(CoordinatorParams(min_workers=2, max_workers=2, target_workers=2))
        coordinator.start_reaper()
        server, port = start_server([...], "127.0.0.1:0", token, TransportOptions())
    """

    def __init__(self, params: CoordinatorParams, clock=time.monotonic):
        self.params = params
        self._clock = clock
        self._cond = threading.Condition()
        self._workers: Dict[str, _Worker] = collections.OrderedDict()
        self._joins = 0
        # Workers blocked in GetMembership right now: alive while the call is open.
        self._waiting: collections.Counter = collections.Counter()
        self._membership = EMPTY
        self._min_reached_at: Optional[float] = None
        self._stop = threading.Event()
        self._reaper: Optional[threading.Thread] = None

    # ---- state ----------------------------------------------------------------------------

    @property
    def membership(self) -> Membership:
        with self._cond:
            return self._membership

    def _live(self) -> List[_Worker]:
        return sorted((w for w in self._workers.values() if w.alive), key=lambda w: w.join_order)

    def _publish_if_changed(self, reason: str) -> None:
        """Publishes a new version when the desired member set differs (call with the lock held)."""
        live = self._live()
        now = self._clock()
        if self._membership.version == 0:
            if len(live) < self.params.min_workers:
                self._min_reached_at = None
                return
            if self._min_reached_at is None:
                self._min_reached_at = now
            enough = len(live) >= self.params.target_workers
            last_call_over = now - self._min_reached_at >= self.params.last_call_s
            if not (enough or last_call_over):
                return
            reason = "formed" if enough else f"formed with {len(live)} workers after the last call"
        members = tuple(Member(w.worker_id, w.address) for w in live[: self.params.max_workers])
        if members == self._membership.members:
            return
        old = self._membership
        self._membership = Membership(old.version + 1, members, reason)
        logger.info(
            "membership version %d -> %d (%s): %s",
            old.version,
            self._membership.version,
            reason,
            [m.worker_id for m in members],
        )
        self._cond.notify_all()

    def reap(self) -> None:
        """Declares workers silent for longer than the heartbeat timeout dead; publishes if needed."""
        with self._cond:
            now = self._clock()
            dead = [
                w
                for w in self._workers.values()
                if w.alive
                and not self._waiting[w.worker_id]
                and now - w.last_heartbeat > self.params.heartbeat_timeout_s
            ]
            for w in dead:
                w.alive = False
                logger.warning(
                    "worker %s (%s) missed heartbeats for %.1fs: declared dead",
                    w.worker_id,
                    w.address,
                    now - w.last_heartbeat,
                )
            reason = f"{', '.join(w.worker_id for w in dead)} missed heartbeats" if dead else "last call"
            self._publish_if_changed(reason)

    def start_reaper(self) -> None:
        def loop():
            period = min(self.params.heartbeat_interval_s, self.params.heartbeat_timeout_s / 4, 0.5)
            while not self._stop.wait(period):
                self.reap()

        self._reaper = threading.Thread(target=loop, name="edl-coordinator-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    # ---- RPCs -----------------------------------------------------------------------------

    def Register(self, request, context):
        if not request.worker_id or not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required")
        with self._cond:
            existing = self._workers.get(request.worker_id)
            if existing is not None and existing.alive:
                if existing.address != request.address:
                    context.abort(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"worker id {request.worker_id!r} is already registered from {existing.address}",
                    )
                existing.last_heartbeat = self._clock()
                join_order = existing.join_order
            else:
                self._joins += 1
                join_order = self._joins
                self._workers.pop(request.worker_id, None)
                self._workers[request.worker_id] = _Worker(
                    request.worker_id, request.address, join_order, self._clock()
                )
                logger.info("worker %s registered from %s (join #%d)", request.worker_id, request.address, join_order)
                self._publish_if_changed(f"{request.worker_id} joined")
        return coordinator_pb2.RegisterResponse(
            join_order=join_order, heartbeat_interval_s=self.params.heartbeat_interval_s
        )

    def GetMembership(self, request, context):
        wait_s = min(max(request.wait_s, 0.0), MAX_MEMBERSHIP_WAIT_S)

        def ready():
            m = self._membership
            return (
                self._stop.is_set()
                or not context.is_active()
                or (m.version > request.after_version and m.rank_of(request.worker_id) >= 0)
            )

        def wake():
            with self._cond:
                self._cond.notify_all()

        context.add_callback(wake)  # the caller hung up or died: stop waiting
        with self._cond:
            self._waiting[request.worker_id] += 1
            try:
                self._cond.wait_for(ready, timeout=wait_s)
            finally:
                self._waiting[request.worker_id] -= 1
            self._touch(request.worker_id)
            return coordinator_pb2.GetMembershipResponse(
                membership=self._membership.to_proto(),
                registered=len(self._live()),
                min_workers=self.params.min_workers,
                max_workers=self.params.max_workers,
            )

    def _touch(self, worker_id: str) -> bool:
        """Records a sign of life; returns whether the worker is known and alive (lock held)."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.alive:
            return False
        worker.last_heartbeat = self._clock()
        return True

    def Heartbeat(self, request, context):
        with self._cond:
            known = self._touch(request.worker_id)
            return coordinator_pb2.HeartbeatResponse(membership_version=self._membership.version, known=known)

    def Leave(self, request, context):
        with self._cond:
            worker = self._workers.get(request.worker_id)
            if worker is not None and worker.alive:
                worker.alive = False
                logger.info("worker %s left: %s", request.worker_id, request.reason or "no reason given")
                self._publish_if_changed(f"{request.worker_id} left")
            return coordinator_pb2.LeaveResponse(membership_version=self._membership.version)
