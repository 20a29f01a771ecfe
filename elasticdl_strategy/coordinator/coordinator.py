"""The coordinator: rendezvous, membership versions, heartbeats, commits and data shards.

One coordinator runs per job, in its own process (the local launcher starts it;
on Kubernetes the master pod runs it). Workers register with a stable worker id
and the address of their peer server; once enough have registered the
coordinator publishes membership version 1, ranks following join order.

After that, membership changes are published as new versions:

* a worker whose heartbeats stop for ``heartbeat_timeout_s``, that a peer
  reports unreachable (and that does not answer a health check), or that leaves
  is removed at once: survivors re-form and roll back to the last commit;
* a worker that registers while a membership trains waits, and joins at the
  next commit, so every member switches at the same step;
* a commit (``Commit``) is recorded as one member (rank 0) sends it once all
  members agreed on it by a collective vote (:mod:`elasticdl_strategy.elastic.agreement`):
  one call per commit, whatever the number of workers.

A restarted coordinator recovers: workers re-register with the membership and
last commit they know, and it adopts the newest.

This module holds the state and the decisions, and never waits: every method
takes the lock, changes the state, and returns an answer — or ``None`` where
the caller is to wait for the next change (:attr:`Coordinator.changes`) and
ask again. Health probes are the caller's too. The gRPC service around it
(:mod:`~elasticdl_strategy.coordinator.service`) does the waiting and the
probing in an event loop, so a long poll holds no thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Dict, List, Optional

import grpc

from elasticdl_strategy.coordinator.changes import Changes
from elasticdl_strategy.coordinator.membership import EMPTY, Member, Membership
from elasticdl_strategy.coordinator.shards import DatasetSpec, ShardTables
from elasticdl_strategy.coordinator.worker_counts import WorkerCounts
from elasticdl_strategy.errors import ConfigError, ElasticDLError, UsageError
from elasticdl_strategy.transport.protos import coordinator_pb2

logger = logging.getLogger(__name__)

# Longest a GetMembership call may block, so that callers' deadlines stay short.
MAX_MEMBERSHIP_WAIT_S = 30.0
# Heartbeats the coordinator asks for per second at most: a job that may grow past this many workers
# per heartbeat interval heartbeats less often (each heartbeat costs the coordinator's one event
# loop ~0.3 ms of CPU; measured with benchmarks/control_plane.py).
MAX_HEARTBEATS_PER_S = 250


class Refusal(ElasticDLError):
    """A request the coordinator answers with an error status (the service ends the call with it)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True)
class CoordinatorParams:
    """How the coordinator forms and keeps the membership.

    Args:
        counts: fewest workers to form a membership with (``min_workers``), most
            in one (``max_workers``; later registrants wait as standbys); the first
            membership is formed as soon as ``counts.target`` have registered (or,
            with at least ``min_workers``, ``last_call_s`` after the
            ``min_workers``-th registered).
        heartbeat_interval_s: how often workers heartbeat; jobs of more than
            :data:`MAX_HEARTBEATS_PER_S` × this many workers are asked for less
            (:attr:`worker_heartbeat_interval_s`).
        heartbeat_timeout_s: silence after which a worker is declared dead.
        last_call_s: see ``counts``.
    """

    counts: WorkerCounts = WorkerCounts(1, 1, 1)
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    last_call_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ConfigError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be positive and below "
                f"heartbeat_timeout_s={self.heartbeat_timeout_s}"
            )
        if self.last_call_s < 0:
            raise ConfigError(f"last_call_s={self.last_call_s} must not be negative")

    @property
    def worker_heartbeat_interval_s(self) -> float:
        """The interval workers are told to heartbeat at: ``heartbeat_interval_s``, or longer for a
        job that may hold more than :data:`MAX_HEARTBEATS_PER_S` workers per second of it (but
        never past a third of the timeout, so that one late heartbeat is not a death).

        >>> large = CoordinatorParams(WorkerCounts.of(1000), heartbeat_interval_s=1, heartbeat_timeout_s=30)
        >>> large.worker_heartbeat_interval_s
        4.0
        >>> CoordinatorParams(WorkerCounts.of(64)).worker_heartbeat_interval_s
        1.0
        """
        spread = self.counts.max_workers / MAX_HEARTBEATS_PER_S
        return max(self.heartbeat_interval_s, min(spread, self.heartbeat_timeout_s / 3))


@dataclasses.dataclass
class _Worker:
    worker_id: str
    address: str
    join_order: int
    last_heartbeat: float
    alive: bool = True
    # False for members adopted from another worker's report after a coordinator restart, until
    # they register themselves: their heartbeats are answered "unknown" so that they report their
    # own last commit (it may be newer).
    reported: bool = True
    incarnation: str = ""  # the registering process; "" when unknown (adopted from another worker's report)
    host: str = ""  # as Member.host


class Coordinator:
    """The membership state of a job, and every decision about it.

    Example:

    >>> from elasticdl_strategy.transport.protos import coordinator_pb2 as pb
    >>> c = Coordinator(CoordinatorParams(WorkerCounts.of(2)))
    >>> for worker_id in ("a", "b"):
    ...     _ = c.register(pb.RegisterRequest(worker_id=worker_id, address=f"h:{worker_id}"))
    >>> c.membership.version, [m.worker_id for m in c.membership.members]
    (1, ['a', 'b'])
    >>> c.membership_answer(pb.GetMembershipRequest(worker_id="a", after_version=1)) is None  # wait
    True
    """

    def __init__(self, params: CoordinatorParams, clock=time.monotonic):
        self.params = params
        self._clock = clock
        self._lock = threading.RLock()
        self.changes = Changes()  # notified on every change a waiting caller may be waiting for
        self._workers: Dict[str, _Worker] = collections.OrderedDict()
        self._joins = 0
        # Workers blocked in GetMembership right now: alive while the call is open.
        self._waiting: collections.Counter = collections.Counter()
        self._membership = EMPTY
        self._min_reached_at: Optional[float] = None
        self._last_commit = coordinator_pb2.CommitRecord()
        self._finished = False
        self._stopped = False
        self.shards = ShardTables()

    # ---- state ----------------------------------------------------------------------------

    @property
    def membership(self) -> Membership:
        with self._lock:
            return self._membership

    @property
    def finished(self) -> bool:
        """Whether a worker reported that training finished (``Leave(finished=True)``)."""
        with self._lock:
            return self._finished

    @property
    def last_commit(self) -> coordinator_pb2.CommitRecord:
        with self._lock:
            return coordinator_pb2.CommitRecord.FromString(self._last_commit.SerializeToString())

    def _live(self) -> List[_Worker]:
        return sorted((w for w in self._workers.values() if w.alive), key=lambda w: w.join_order)

    def _live_count(self) -> int:
        return sum(1 for w in self._workers.values() if w.alive)

    def _ready(self, membership: Membership) -> bool:
        return membership.size >= self.params.counts.min_workers

    def _publish_if_changed(self, reason: str, admit: bool = True, force: bool = False) -> None:
        """Publishes a new version when the member set should change (call with the lock held).

        Members that are still alive keep their order; with ``admit``, live
        non-members are added in join order up to ``max_workers``. ``force``
        publishes even an unchanged member set (survivors of a failed collective
        re-form without a member missing).
        """
        if self._finished:
            return  # the job is done: no more memberships
        now = self._clock()
        if self._membership.version == 0:
            registered = self._live_count()  # counted first: every registration asks, sorting them is for forming
            if registered < self.params.counts.min_workers:
                self._min_reached_at = None
                return
            if self._min_reached_at is None:
                self._min_reached_at = now
            enough = registered >= self.params.counts.target
            last_call_over = now - self._min_reached_at >= self.params.last_call_s
            if not (enough or last_call_over):
                return
            reason = "formed" if enough else f"formed with {registered} workers after the last call"
            chosen = self._live()[: self.params.counts.max_workers]
        else:
            live = self._live()
            alive = {w.worker_id for w in live}
            chosen = [self._workers[m.worker_id] for m in self._membership.members if m.worker_id in alive]
            if admit or not self._ready(self._membership):
                taken = {w.worker_id for w in chosen}
                chosen += [w for w in live if w.worker_id not in taken][: self.params.counts.max_workers - len(chosen)]
        members = tuple(Member(w.worker_id, w.address, w.host) for w in chosen)
        if members == self._membership.members and not force:
            return
        old = self._membership
        self._membership = Membership(old.version + 1, members, reason)
        waiting = (
            "" if self._ready(self._membership) else f"; below --min-workers={self.params.counts.min_workers}, waiting"
        )
        logger.info(
            "membership version %d -> %d (%s): %s%s",
            old.version,
            self._membership.version,
            reason,
            _change(old, self._membership),
            waiting,
        )
        self.changes.notify()

    def reap(self) -> None:
        """Declares workers silent for longer than the heartbeat timeout dead; publishes if needed."""
        with self._lock:
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
            if not dead and self._membership.version > 0 and self._ready(self._membership):
                return  # nothing for a tick to change: joiners wait for a commit
            reason = f"{', '.join(w.worker_id for w in dead)} missed heartbeats" if dead else "last call"
            # Joiners are admitted with a removal (the members re-form anyway), never on a mere tick:
            # otherwise they would interrupt the members between two commits.
            self._publish_if_changed(reason, admit=bool(dead))

    def stop(self) -> None:
        """Ends every wait: callers waiting for a change get their answer now."""
        with self._lock:
            self._stopped = True
        self.changes.notify()

    @property
    def reap_period_s(self) -> float:
        """How often :meth:`reap` should run."""
        return min(self.params.heartbeat_interval_s, self.params.heartbeat_timeout_s / 4, 0.5)

    # ---- membership -----------------------------------------------------------------------

    def register(self, request, probed: Optional[_Worker] = None) -> Optional[coordinator_pb2.RegisterResponse]:
        """Registers a worker; returns ``None`` when :meth:`conflict` must be probed first.

        Another process under a live worker's id, at another address, is either
        that worker restarted (its old address silent) or a second process given
        the same id. The caller probes ``conflict(request)`` and calls again with
        it as ``probed`` once it is known not to answer; if it changed meanwhile,
        this returns ``None`` again.

        Raises:
            Refusal: the request lacks a worker id or an address.
        """
        if not request.worker_id or not request.address:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required")
        with self._lock:
            conflict = self._conflict(request)
            if conflict is not None and conflict is not probed:
                return None
            return self._register(request)

    def conflict(self, request) -> Optional[_Worker]:
        """The live worker of ``request``'s id whose process elsewhere must be probed, if any."""
        with self._lock:
            return self._conflict(request)

    def _conflict(self, request) -> Optional[_Worker]:
        seen = self._workers.get(request.worker_id)
        if seen is not None and seen.alive and self._other_process(seen, request) and seen.address != request.address:
            return seen
        return None

    def _register(self, request) -> coordinator_pb2.RegisterResponse:
        """Registers the worker (lock held; a live process elsewhere under its id was ruled out)."""
        if request.membership.version > self._membership.version:
            self._recover(request)
        elif (
            request.membership.version == self._membership.version
            and request.last_commit.commit_id > self._last_commit.commit_id
            and request.last_commit.membership_version == self._membership.version
        ):
            # Another worker of the recovered membership knows a later commit than the first reported.
            self._last_commit.CopyFrom(request.last_commit)
        existing = self._workers.get(request.worker_id)
        if existing is not None and existing.alive and self._other_process(existing, request):
            # Its previous process is gone, and its state with it: remove that member now; the new
            # process joins like any new worker (at the back of the order, synced at a commit).
            existing.alive = False
            logger.warning(
                "worker %s restarted (a new process at %s): its previous process is gone",
                request.worker_id,
                request.address,
            )
            self._publish_if_changed(f"{request.worker_id} restarted", admit=False)
        running = self._membership.version > 0 and self._membership.rank_of(request.worker_id) < 0
        if existing is not None and existing.alive:
            existing.last_heartbeat = self._clock()
            existing.reported = True
            existing.incarnation = existing.incarnation or request.incarnation
            join_order = existing.join_order
        else:
            self._joins += 1
            join_order = self._joins
            self._workers.pop(request.worker_id, None)
            self._workers[request.worker_id] = _Worker(
                request.worker_id,
                request.address,
                join_order,
                self._clock(),
                incarnation=request.incarnation,
                host=request.host,
            )
            logger.info("worker %s registered from %s (join #%d)", request.worker_id, request.address, join_order)
            if self._membership.version > 0 and self._ready(self._membership):
                logger.info("worker %s joins the running job at its next commit", request.worker_id)
            self._publish_if_changed(f"{request.worker_id} joined", admit=False)
        return coordinator_pb2.RegisterResponse(
            join_order=join_order,
            heartbeat_interval_s=self.params.worker_heartbeat_interval_s,
            joins_running_job=running,
        )

    @staticmethod
    def _other_process(existing: _Worker, request) -> bool:
        """Whether ``request`` comes from another process than the one ``existing`` stands for: by
        incarnation, or by address where one is unknown (adopted after a coordinator restart)."""
        if existing.incarnation and request.incarnation:
            return existing.incarnation != request.incarnation
        return existing.address != request.address

    def _recover(self, request) -> None:
        """Adopts the membership and last commit a worker reports (this coordinator restarted)."""
        membership = Membership.from_proto(request.membership)
        logger.warning(
            "worker %s reports membership version %d (this coordinator is at %d): "
            "adopting it and its last commit #%d (coordinator restart)",
            request.worker_id,
            membership.version,
            self._membership.version,
            request.last_commit.commit_id,
        )
        now = self._clock()
        for member in membership.members:
            if member.worker_id not in self._workers or not self._workers[member.worker_id].alive:
                self._joins += 1
                reported = member.worker_id == request.worker_id
                self._workers[member.worker_id] = _Worker(
                    member.worker_id, member.address, self._joins, now, True, reported, host=member.host
                )
        self._membership = membership
        if request.last_commit.commit_id > self._last_commit.commit_id:
            self._last_commit.CopyFrom(request.last_commit)
        self.changes.notify()

    def membership_answer(self, request, waited_out: bool = False) -> Optional[coordinator_pb2.GetMembershipResponse]:
        """The answer to a membership long poll, or ``None`` while it should wait.

        A poll is answered once a membership after ``request.after_version``
        holds the worker and has enough members, or when the job finished, the
        coordinator stops, the worker's process was replaced, or (``waited_out``)
        the poll's time is up. While the caller waits, bracket the wait with
        :meth:`waiting`: a worker that waits is alive.
        """
        with self._lock:
            if self._replaced(request.worker_id, request.incarnation):
                return coordinator_pb2.GetMembershipResponse(membership=self._membership.to_proto(), replaced=True)
            m = self._membership
            ready = m.version > request.after_version and m.rank_of(request.worker_id) >= 0 and self._ready(m)
            if not (ready or waited_out or self._stopped or self._finished):
                return None
            self._touch(request.worker_id)
            return coordinator_pb2.GetMembershipResponse(
                membership=self._membership.to_proto(),
                registered=self._live_count(),
                min_workers=self.params.counts.min_workers,
                max_workers=self.params.counts.max_workers,
                last_commit=self._last_commit,
                job_finished=self._finished,
            )

    def waiting(self, worker_id: str, waits: bool) -> None:
        """Marks the start (``waits``) or the end of a long poll of ``worker_id``."""
        with self._lock:
            self._waiting[worker_id] += 1 if waits else -1
            if not self._waiting[worker_id]:
                del self._waiting[worker_id]

    def _touch(self, worker_id: str) -> bool:
        """Records a sign of life; returns whether the worker is known and alive (lock held)."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.alive:
            return False
        worker.last_heartbeat = self._clock()
        return True

    def _replaced(self, worker_id: str, incarnation: str) -> bool:
        """Whether a newer process than ``incarnation`` registered as ``worker_id`` (lock held)."""
        worker = self._workers.get(worker_id)
        return bool(worker is not None and worker.incarnation and incarnation and worker.incarnation != incarnation)

    def heartbeat(self, request) -> coordinator_pb2.HeartbeatResponse:
        with self._lock:
            version = self._membership.version
            if self._replaced(request.worker_id, request.incarnation):
                return coordinator_pb2.HeartbeatResponse(membership_version=version, known=False, replaced=True)
            known = self._touch(request.worker_id) and self._workers[request.worker_id].reported
            return coordinator_pb2.HeartbeatResponse(membership_version=version, known=known)

    def leave(self, request) -> coordinator_pb2.LeaveResponse:
        with self._lock:
            if self._replaced(request.worker_id, request.incarnation):  # must not remove its successor
                logger.info("ignored the leave of worker %s's replaced process", request.worker_id)
                return coordinator_pb2.LeaveResponse(membership_version=self._membership.version)
            worker = self._workers.get(request.worker_id)
            if request.finished and not self._finished:
                self._finished = True
                logger.info("worker %s finished the job: workers waiting to join are released", request.worker_id)
                self.changes.notify()
            if worker is not None and worker.alive:
                worker.alive = False
                logger.info("worker %s left: %s", request.worker_id, request.reason or "no reason given")
                if not self._finished:
                    self._publish_if_changed(f"{request.worker_id} left")
            return coordinator_pb2.LeaveResponse(membership_version=self._membership.version)

    # ---- failures -------------------------------------------------------------------------

    def failure_suspects(self, request) -> Optional[List[_Worker]]:
        """The workers a failure report names, for the caller to probe; ``None`` when the report
        is stale (another membership, or a replaced process)."""
        with self._lock:
            if request.membership_version != self._membership.version or self._replaced(
                request.worker_id, request.incarnation
            ):
                return None
            return [self._workers[s] for s in request.suspects if s in self._workers]

    def report_failure(self, request, unreachable: List[_Worker]) -> coordinator_pb2.FailureReportResponse:
        """Acts on a failure report: the ``unreachable`` suspects (as :meth:`failure_suspects`
        returned them; they did not answer a probe) are declared dead — not a process that
        registered under one's id meanwhile — and the members re-form (a new version, even with
        the same members)."""
        with self._lock:
            if request.membership_version == self._membership.version:
                for w in unreachable:
                    if w.alive:
                        w.alive = False
                        logger.warning("worker %s (%s) does not answer: declared dead", w.worker_id, w.address)
                names = ", ".join(w.worker_id for w in unreachable)
                reason = f"{request.worker_id} reported: {request.reason}" + (f"; {names} unreachable" if names else "")
                self._publish_if_changed(reason, force=True)
            return coordinator_pb2.FailureReportResponse(membership_version=self._membership.version)

    # ---- commits --------------------------------------------------------------------------

    def commit(self, request) -> coordinator_pb2.CommitResponse:
        """Records the commit that every member of ``request.membership_version`` agreed on
        (sent by one of them, rank 0); ``request.leaving_workers`` leave the job here.

        Returns:
            ``recorded`` with the membership to continue in (leavers gone, joiners admitted), or
            not recorded when the membership changed since (a member failed: all roll back).

        Raises:
            Refusal: a leaver that is not a member (``INVALID_ARGUMENT``).
        """
        with self._lock:
            if self._replaced(request.worker_id, request.incarnation):
                return self._commit_response(False, "a newer process registered under this worker id")
            self._touch(request.worker_id)
            if self._is_recorded(request):  # a retry whose answer was lost
                return self._commit_response(True, "recorded")
            m = self._membership
            if request.membership_version != m.version or m.rank_of(request.worker_id) < 0:
                return self._commit_response(False, f"membership changed to version {m.version} ({m.reason})")
            strangers = sorted(w for w in set(request.leaving_workers) if m.rank_of(w) < 0)
            if strangers:
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{strangers} leave at commit #{request.commit_id} but are not members of version {m.version}",
                )
            self._record(request)
            return self._commit_response(True, "recorded")

    def _is_recorded(self, request) -> bool:
        last = self._last_commit
        return last.commit_id == request.commit_id and last.membership_version == request.membership_version

    def _commit_response(self, recorded: bool, reason: str) -> coordinator_pb2.CommitResponse:
        return coordinator_pb2.CommitResponse(
            recorded=recorded, membership_version=self._membership.version, reason=reason
        )

    def _record(self, request) -> None:
        self._last_commit = coordinator_pb2.CommitRecord(
            commit_id=request.commit_id, membership_version=request.membership_version, position=request.position
        )
        leaving = sorted(set(request.leaving_workers))
        for worker_id in leaving:
            self._workers[worker_id].alive = False
        reason = f"{', '.join(leaving)} left gracefully at commit #{request.commit_id}" if leaving else ""
        self._publish_if_changed(reason or f"workers joined at commit #{request.commit_id}", admit=True)
        self.changes.notify()

    # ---- data ---------------------------------------------------------------------------

    def get_shards(self, request) -> coordinator_pb2.GetShardsResponse:
        """The shards of ``request.epoch`` of the job's dataset (registered by the first call).

        Raises:
            Refusal: the spec is invalid or differs from the registered one: ``INVALID_ARGUMENT``.
        """
        s = request.spec
        try:
            spec = DatasetSpec(s.num_records, s.shard_size, s.seed, s.shuffle, s.fingerprint)
            starts, ends = self.shards.get(spec, request.epoch)
        except UsageError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return coordinator_pb2.GetShardsResponse(starts=starts.tolist(), ends=ends.tolist())


def _change(old: Membership, new: Membership, listed: int = 16) -> str:
    """``old -> new`` members for a log line: the lists while short, else the counts and who left and joined."""
    if max(old.size, new.size) <= listed:
        return f"{[m.worker_id for m in old.members]} -> {[m.worker_id for m in new.members]}"
    before, after = {m.worker_id for m in old.members}, {m.worker_id for m in new.members}
    left, joined = sorted(before - after), sorted(after - before)

    def some(ids: List[str]) -> str:
        return ", ".join(ids[:listed]) + (f" and {len(ids) - listed} more" if len(ids) > listed else "")

    return (
        f"{old.size} -> {new.size} members"
        + (f"; left: {some(left)}" if left else "")
        + (f"; joined: {some(joined)}" if joined else "")
    )
