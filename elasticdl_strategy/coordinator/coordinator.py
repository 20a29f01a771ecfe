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
* a commit (``Commit``) is a barrier over the members: it is recorded, with the
  data position every rank reported, only when all members sent it.

A restarted coordinator recovers: workers re-register with the membership and
last commit they know, and it adopts the newest.
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
from elasticdl_strategy.coordinator.shards import DatasetSpec, ShardTables
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.health import answers_health_check
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)

# Longest a GetMembership call may block, so that callers' deadlines stay short.
MAX_MEMBERSHIP_WAIT_S = 30.0
# How long a reported peer gets to answer a health check before it is declared dead.
_PROBE_TIMEOUT_S = 1.0


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
    # False for members adopted from another worker's report after a coordinator restart, until
    # they register themselves: their heartbeats are answered "unknown" so that they report their
    # own last commit (it may be newer).
    reported: bool = True
    incarnation: str = ""  # the registering process; "" when unknown (adopted from another worker's report)


@dataclasses.dataclass
class _Barrier:
    """Commits received for one commit id in one membership version."""

    version: int
    commit_id: int
    position: coordinator_pb2.DataPosition
    arrived: Dict[str, bool] = dataclasses.field(default_factory=dict)  # worker id -> leaving
    error: str = ""


def _position_text(p: coordinator_pb2.DataPosition) -> str:
    return f"(epoch {p.epoch}, batch {p.batch}, record {p.cursor})"


class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Membership state and the ``Coordinator`` gRPC service.

    Example (in-process, as the tests do)::

        coordinator = Coordinator(CoordinatorParams(min_workers=2, max_workers=2, target_workers=2))
        coordinator.start_reaper()
        server, port = start_server([...], "127.0.0.1:0", token, TransportOptions())
    """

    def __init__(self, params: CoordinatorParams, clock=time.monotonic, options: Optional[TransportOptions] = None):
        self.params = params
        self._clock = clock
        self._options = options or TransportOptions()
        self._cond = threading.Condition()
        self._workers: Dict[str, _Worker] = collections.OrderedDict()
        self._joins = 0
        # Workers blocked in GetMembership right now: alive while the call is open.
        self._waiting: collections.Counter = collections.Counter()
        self._membership = EMPTY
        self._min_reached_at: Optional[float] = None
        self._last_commit = coordinator_pb2.CommitRecord()
        self._barrier: Optional[_Barrier] = None
        self._finished = False
        self.shards = ShardTables()
        self._stop = threading.Event()
        self._reaper: Optional[threading.Thread] = None

    # ---- state ----------------------------------------------------------------------------

    @property
    def membership(self) -> Membership:
        with self._cond:
            return self._membership

    @property
    def finished(self) -> bool:
        """Whether a worker reported that training finished (``Leave(finished=True)``)."""
        with self._cond:
            return self._finished

    @property
    def last_commit(self) -> coordinator_pb2.CommitRecord:
        with self._cond:
            return coordinator_pb2.CommitRecord.FromString(self._last_commit.SerializeToString())

    def _live(self) -> List[_Worker]:
        return sorted((w for w in self._workers.values() if w.alive), key=lambda w: w.join_order)

    def _ready(self, membership: Membership) -> bool:
        return membership.size >= self.params.min_workers

    def _publish_if_changed(self, reason: str, admit: bool = True, force: bool = False) -> None:
        """Publishes a new version when the member set should change (call with the lock held).

        Members that are still alive keep their order; with ``admit``, live
        non-members are added in join order up to ``max_workers``. ``force``
        publishes even an unchanged member set (survivors of a failed collective
        re-form without a member missing).
        """
        if self._finished:
            return  # the job is done: no more memberships
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
            chosen = live[: self.params.max_workers]
        else:
            alive = {w.worker_id for w in live}
            chosen = [self._workers[m.worker_id] for m in self._membership.members if m.worker_id in alive]
            if admit or not self._ready(self._membership):
                taken = {w.worker_id for w in chosen}
                chosen += [w for w in live if w.worker_id not in taken][: self.params.max_workers - len(chosen)]
        members = tuple(Member(w.worker_id, w.address) for w in chosen)
        if members == self._membership.members and not force:
            return
        old = self._membership
        self._membership = Membership(old.version + 1, members, reason)
        self._barrier = None
        waiting = "" if self._ready(self._membership) else f"; below --min-workers={self.params.min_workers}, waiting"
        logger.info(
            "membership version %d -> %d (%s): %s -> %s%s",
            old.version,
            self._membership.version,
            reason,
            [m.worker_id for m in old.members],
            [m.worker_id for m in members],
            waiting,
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
            # Joiners are admitted with a removal (the members re-form anyway), never on a mere tick:
            # otherwise they would interrupt the members between two commits.
            self._publish_if_changed(reason, admit=bool(dead))

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

    # ---- RPCs: membership -----------------------------------------------------------------

    def Register(self, request, context):
        if not request.worker_id or not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required")
        for _ in range(3):
            with self._cond:
                seen = self._workers.get(request.worker_id)
                suspect = seen is not None and seen.alive and self._other_process(seen, request)
            # Another process under a live worker's id, elsewhere: a restart if the old address is
            # silent, else two processes given the same id (probed outside the lock: up to a second).
            if suspect and seen.address != request.address and self._probe(seen.address):
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"worker id {request.worker_id!r} is already used by a live process at {seen.address}",
                )
            with self._cond:
                if self._workers.get(request.worker_id) is seen:  # else it changed while probing: look again
                    return self._register(request, context)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"worker id {request.worker_id!r} is being registered concurrently")

    def _register(self, request, context) -> coordinator_pb2.RegisterResponse:
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
                request.worker_id, request.address, join_order, self._clock(), incarnation=request.incarnation
            )
            logger.info("worker %s registered from %s (join #%d)", request.worker_id, request.address, join_order)
            if self._membership.version > 0 and self._ready(self._membership):
                logger.info("worker %s joins the running job at its next commit", request.worker_id)
            self._publish_if_changed(f"{request.worker_id} joined", admit=False)
        return coordinator_pb2.RegisterResponse(
            join_order=join_order, heartbeat_interval_s=self.params.heartbeat_interval_s, joins_running_job=running
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
                    member.worker_id, member.address, self._joins, now, True, reported
                )
        self._membership = membership
        self._barrier = None
        if request.last_commit.commit_id > self._last_commit.commit_id:
            self._last_commit.CopyFrom(request.last_commit)
        self._cond.notify_all()

    def GetMembership(self, request, context):
        wait_s = min(max(request.wait_s, 0.0), MAX_MEMBERSHIP_WAIT_S)

        def ready():
            m = self._membership
            return (
                self._stop.is_set()
                or self._finished
                or not context.is_active()
                or self._replaced(request.worker_id, request.incarnation)
                or (m.version > request.after_version and m.rank_of(request.worker_id) >= 0 and self._ready(m))
            )

        def wake():
            with self._cond:
                self._cond.notify_all()

        context.add_callback(wake)  # the caller hung up or died: stop waiting
        with self._cond:
            if self._replaced(request.worker_id, request.incarnation):
                return coordinator_pb2.GetMembershipResponse(membership=self._membership.to_proto(), replaced=True)
            self._waiting[request.worker_id] += 1
            try:
                self._cond.wait_for(ready, timeout=wait_s)
            finally:
                self._waiting[request.worker_id] -= 1
            if self._replaced(request.worker_id, request.incarnation):  # while it waited
                return coordinator_pb2.GetMembershipResponse(membership=self._membership.to_proto(), replaced=True)
            self._touch(request.worker_id)
            return coordinator_pb2.GetMembershipResponse(
                membership=self._membership.to_proto(),
                registered=len(self._live()),
                min_workers=self.params.min_workers,
                max_workers=self.params.max_workers,
                last_commit=self._last_commit,
                job_finished=self._finished,
            )

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

    def Heartbeat(self, request, context):
        with self._cond:
            version = self._membership.version
            if self._replaced(request.worker_id, request.incarnation):
                return coordinator_pb2.HeartbeatResponse(membership_version=version, known=False, replaced=True)
            known = self._touch(request.worker_id) and self._workers[request.worker_id].reported
            return coordinator_pb2.HeartbeatResponse(membership_version=version, known=known)

    def Leave(self, request, context):
        with self._cond:
            if self._replaced(request.worker_id, request.incarnation):  # must not remove its successor
                logger.info("ignored the leave of worker %s's replaced process", request.worker_id)
                return coordinator_pb2.LeaveResponse(membership_version=self._membership.version)
            worker = self._workers.get(request.worker_id)
            if request.finished and not self._finished:
                self._finished = True
                logger.info("worker %s finished the job: workers waiting to join are released", request.worker_id)
                self._cond.notify_all()
            if worker is not None and worker.alive:
                worker.alive = False
                logger.info("worker %s left: %s", request.worker_id, request.reason or "no reason given")
                if not self._finished:
                    self._publish_if_changed(f"{request.worker_id} left")
            return coordinator_pb2.LeaveResponse(membership_version=self._membership.version)

    # ---- RPCs: failures -------------------------------------------------------------------

    def _probe(self, address: str) -> bool:
        """Whether the worker at ``address`` answers a gRPC health check quickly."""
        return answers_health_check(address, self._options, timeout=_PROBE_TIMEOUT_S)

    def ReportFailure(self, request, context):
        with self._cond:
            if request.membership_version != self._membership.version or self._replaced(
                request.worker_id, request.incarnation
            ):
                return coordinator_pb2.FailureReportResponse(membership_version=self._membership.version)
            suspects = [self._workers[s] for s in request.suspects if s in self._workers]
        unreachable = [w for w in suspects if not self._probe(w.address)]
        with self._cond:
            if request.membership_version == self._membership.version:
                for w in unreachable:
                    if w.alive:
                        w.alive = False
                        logger.warning("worker %s (%s) does not answer: declared dead", w.worker_id, w.address)
                gone = ", ".join(w.worker_id for w in unreachable)
                reason = f"{request.worker_id} reported: {request.reason}" + (f"; {gone} unreachable" if gone else "")
                self._publish_if_changed(reason, force=True)
            return coordinator_pb2.FailureReportResponse(membership_version=self._membership.version)

    # ---- RPCs: commits --------------------------------------------------------------------

    def Commit(self, request, context):
        with self._cond:
            response = self._enter_commit(request)
            if response is not None:
                return response
            if self._is_recorded(request):  # this was the last member to arrive
                return self._commit_response(True, "recorded")
            barrier = self._barrier

            def settled():
                return (
                    self._stop.is_set()
                    or not context.is_active()
                    or self._barrier is not barrier
                    or bool(barrier.error)
                    or self._is_recorded(request)
                )

            self._cond.wait_for(settled, timeout=MAX_MEMBERSHIP_WAIT_S)
            if self._is_recorded(request):
                return self._commit_response(True, "recorded")
            if barrier.error:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, barrier.error)
            if self._membership.version != request.membership_version:
                return self._commit_response(False, self._membership.reason)
            missing = [m.worker_id for m in self._membership.members if m.worker_id not in barrier.arrived]
            return self._commit_response(False, f"still waiting for {missing}")

    def _is_recorded(self, request) -> bool:
        last = self._last_commit
        return last.commit_id == request.commit_id and last.membership_version == request.membership_version

    def _commit_response(self, recorded: bool, reason: str) -> coordinator_pb2.CommitResponse:
        return coordinator_pb2.CommitResponse(
            recorded=recorded, membership_version=self._membership.version, reason=reason
        )

    def _enter_commit(self, request) -> Optional[coordinator_pb2.CommitResponse]:
        """Adds ``request`` to the barrier (lock held); returns a response when there is no need to wait."""
        if self._replaced(request.worker_id, request.incarnation):
            return self._commit_response(False, "a newer process registered under this worker id")
        self._touch(request.worker_id)
        if self._is_recorded(request):
            return self._commit_response(True, "recorded")
        m = self._membership
        if request.membership_version != m.version or m.rank_of(request.worker_id) < 0:
            return self._commit_response(False, f"membership changed to version {m.version} ({m.reason})")
        barrier = self._barrier
        if barrier is None or barrier.commit_id != request.commit_id:
            if barrier is not None and barrier.arrived:
                barrier.error = (
                    f"{request.worker_id} commits #{request.commit_id} while "
                    f"{sorted(barrier.arrived)} commit #{barrier.commit_id}: every worker must commit at the same steps"
                )
                self._cond.notify_all()
                return None
            barrier = self._barrier = _Barrier(m.version, request.commit_id, request.position)
        if request.position != barrier.position:
            barrier.error = (
                f"{request.worker_id} commits #{request.commit_id} at data position "
                f"{_position_text(request.position)} but {sorted(barrier.arrived)} at "
                f"{_position_text(barrier.position)}: the workers disagree on the data consumed"
            )
            self._cond.notify_all()
            return None
        barrier.arrived[request.worker_id] = request.leaving
        if all(member.worker_id in barrier.arrived for member in m.members):
            self._record(barrier)
        return None

    def _record(self, barrier: _Barrier) -> None:
        self._last_commit = coordinator_pb2.CommitRecord(
            commit_id=barrier.commit_id, membership_version=barrier.version, position=barrier.position
        )
        leaving = [worker_id for worker_id, leaves in barrier.arrived.items() if leaves]
        for worker_id in leaving:
            self._workers[worker_id].alive = False
        self._barrier = None
        reason = f"{', '.join(leaving)} left gracefully at commit #{barrier.commit_id}" if leaving else ""
        self._publish_if_changed(reason or f"workers joined at commit #{barrier.commit_id}", admit=True)
        self._cond.notify_all()

    # ---- RPCs: data -----------------------------------------------------------------------

    def GetShards(self, request, context):
        s = request.spec
        try:
            spec = DatasetSpec(s.num_records, s.shard_size, s.seed, s.shuffle)
            starts, ends = self.shards.get(spec, request.epoch)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return coordinator_pb2.GetShardsResponse(starts=starts.tolist(), ends=ends.tolist())
