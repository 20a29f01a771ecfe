"""Every decision of the coordinator, as pure functions: ``transition(params, state, event, now)``
returns the next state, the answer to the event's call, and what to log and whether waiting calls
should ask again. Nothing here waits, probes, logs or reads a clock.

Rules, in one place each:

* The first membership forms once ``counts.target`` workers registered, or ``last_call_s``
  after ``min_workers`` did (:func:`_publish`); ranks follow join order.
* A worker whose heartbeats stop for ``heartbeat_timeout_s`` (:class:`~.events.Tick`), that a
  peer reports and that does not answer a probe (:class:`~.events.ReportFailure`), that leaves, or
  whose process is replaced is removed at once: survivors re-form and roll back to the last commit.
* A worker that registers while a membership trains waits, and joins at the next commit
  (:class:`~.events.Commit`), so every member switches at the same step.
* A worker reporting a newer membership than the coordinator's means the coordinator restarted:
  it adopts that membership and its last commit (:func:`_recover`).

Example:

>>> from elasticdl_strategy.coordinator.worker_counts import WorkerCounts
>>> from elasticdl_strategy.transport.protos import coordinator_pb2 as pb
>>> params, state = CoordinatorParams(WorkerCounts.of(2)), JobState()
>>> for worker_id in ("a", "b"):
...     registers = events.Register(pb.RegisterRequest(worker_id=worker_id, address=f"h:{worker_id}"))
...     state = transition(params, state, registers, now=0.0).state
>>> state.membership.version, [m.worker_id for m in state.membership.members]
(1, ['a', 'b'])
>>> transition(params, state, events.Poll(pb.GetMembershipRequest(worker_id="a", after_version=1)), 1.0).answer
Wait()
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import grpc

from elasticdl_strategy.coordinator import events
from elasticdl_strategy.coordinator.membership import Member, Membership
from elasticdl_strategy.coordinator.params import CoordinatorParams
from elasticdl_strategy.coordinator.state import JobState, Worker
from elasticdl_strategy.transport.protos import coordinator_pb2

# A line to log: level, format, arguments (formatted only if logged).
Log = Tuple[int, str, Tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class Transition:
    """The outcome of an event.

    Attributes:
        state: the new state (the old one where nothing changed).
        answer: for the event's call; ``None`` for events without one (:class:`~.events.Tick`, ...).
        logs: lines to log, in order.
        wake: waiting calls should ask again (:class:`~.events.Wait` answered them before).
    """

    state: JobState
    answer: Optional[events.Answer] = None
    logs: Tuple[Log, ...] = ()
    wake: bool = False


class _Effects:
    """What a transition logs and whether it wakes waiters, gathered while it decides."""

    def __init__(self) -> None:
        self.logs: List[Log] = []
        self.wake = False

    def log(self, level: int, message: str, *args: Any) -> None:
        self.logs.append((level, message, args))


Handler = Callable[[CoordinatorParams, JobState, Any, float, _Effects], Tuple[JobState, Optional[events.Answer]]]


def transition(params: CoordinatorParams, state: JobState, event: events.Event, now: float) -> Transition:
    """The next state and the answer after ``event`` at time ``now``; ``state`` is left as it was."""
    effects = _Effects()
    new, answer = _HANDLERS[type(event)](params, state, event, now, effects)
    return Transition(new, answer, tuple(effects.logs), effects.wake)


# ---- state helpers ----------------------------------------------------------------------------


def _with_workers(state: JobState, changed: Iterable[Worker]) -> JobState:
    workers = dict(state.workers)
    for worker in changed:
        workers[worker.worker_id] = worker
    return dataclasses.replace(state, workers=workers)


def _touch(state: JobState, worker_id: str, now: float) -> Tuple[JobState, bool]:
    """Records a sign of life; also returns whether the worker is known and alive."""
    worker = state.workers.get(worker_id)
    if worker is None or not worker.alive:
        return state, False
    return _with_workers(state, [dataclasses.replace(worker, last_heartbeat=now)]), True


def _ready(params: CoordinatorParams, membership: Membership) -> bool:
    return membership.size >= params.counts.min_workers


def _other_process(existing: Worker, request) -> bool:
    """Whether ``request`` comes from another process than the one ``existing`` stands for: by
    incarnation, or by address where one is unknown (adopted after a coordinator restart)."""
    if existing.incarnation and request.incarnation:
        return existing.incarnation != request.incarnation
    return existing.address != request.address


def _publish(
    params: CoordinatorParams,
    state: JobState,
    now: float,
    effects: _Effects,
    reason: str,
    admit: bool = True,
    force: bool = False,
) -> JobState:
    """Publishes a new version where the member set should change.

    Members that are still alive keep their order; with ``admit``, live
    non-members are added in join order up to ``max_workers``. ``force``
    publishes even an unchanged member set (survivors of a failed collective
    re-form without a member missing).
    """
    if state.finished:
        return state  # the job is done: no more memberships
    old = state.membership
    if old.version == 0:
        registered = state.live_count()  # counted first: every registration asks, sorting them is for forming
        if registered < params.counts.min_workers:
            return dataclasses.replace(state, min_reached_at=None) if state.min_reached_at is not None else state
        if state.min_reached_at is None:
            state = dataclasses.replace(state, min_reached_at=now)
        enough = registered >= params.counts.target
        last_call_over = now - state.min_reached_at >= params.last_call_s  # type: ignore[operator]
        if not (enough or last_call_over):
            return state
        reason = "formed" if enough else f"formed with {registered} workers after the last call"
        chosen = state.live()[: params.counts.max_workers]
    else:
        live = state.live()
        alive = {w.worker_id for w in live}
        chosen = [state.workers[m.worker_id] for m in old.members if m.worker_id in alive]
        if admit or not _ready(params, old):
            taken = {w.worker_id for w in chosen}
            chosen += [w for w in live if w.worker_id not in taken][: params.counts.max_workers - len(chosen)]
    members = tuple(Member(w.worker_id, w.address, w.host) for w in chosen)
    if members == old.members and not force:
        return state
    new = Membership(old.version + 1, members, reason)
    waiting = "" if _ready(params, new) else f"; below --min-workers={params.counts.min_workers}, waiting"
    effects.log(
        logging.INFO,
        "membership version %d -> %d (%s): %s%s",
        old.version,
        new.version,
        reason,
        _change(old, new),
        waiting,
    )
    effects.wake = True
    return dataclasses.replace(state, membership=new)


# ---- events -----------------------------------------------------------------------------------


def _on_tick(params: CoordinatorParams, state: JobState, event: events.Tick, now: float, effects: _Effects):
    timeout = params.heartbeat_timeout_s
    dead = [
        w
        for w in state.workers.values()
        if w.alive and not state.polling.get(w.worker_id) and now - w.last_heartbeat > timeout
    ]
    for w in dead:
        effects.log(
            logging.WARNING,
            "worker %s (%s) missed heartbeats for %.1fs: declared dead",
            w.worker_id,
            w.address,
            now - w.last_heartbeat,
        )
    state = _with_workers(state, [dataclasses.replace(w, alive=False) for w in dead]) if dead else state
    if not dead and state.membership.version > 0 and _ready(params, state.membership):
        return state, None  # nothing for a tick to change: joiners wait for a commit
    reason = f"{', '.join(w.worker_id for w in dead)} missed heartbeats" if dead else "last call"
    # Joiners are admitted with a removal (the members re-form anyway), never on a mere tick:
    # otherwise they would interrupt the members between two commits.
    return _publish(params, state, now, effects, reason, admit=bool(dead)), None


def _on_stop(params: CoordinatorParams, state: JobState, event: events.Stop, now: float, effects: _Effects):
    effects.wake = True
    return dataclasses.replace(state, stopped=True), None


def _conflict(state: JobState, request) -> Optional[Worker]:
    """The live worker of ``request``'s id whose process elsewhere must be probed, if any."""
    seen = state.workers.get(request.worker_id)
    if seen is not None and seen.alive and _other_process(seen, request) and seen.address != request.address:
        return seen
    return None


def _on_register(params: CoordinatorParams, state: JobState, event: events.Register, now: float, effects: _Effects):
    """Another process under a live worker's id, at another address, is either that worker
    restarted (its old address silent) or a second process given the same id: the old one is
    probed first, and the registration refused while it answers."""
    request = event.request
    if not request.worker_id or not request.address:
        return state, events.Refuse(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required")
    conflict = _conflict(state, request)
    if conflict is not None:
        answered = event.probed.get(conflict.join_order)
        if answered is None:
            return state, events.Probe((events.Target(conflict.worker_id, conflict.address, conflict.join_order),))
        if answered:
            message = f"worker id {request.worker_id!r} is already used by a live process at {conflict.address}"
            return state, events.Refuse(grpc.StatusCode.ALREADY_EXISTS, message)
    return _register(params, state, request, now, effects)


def _register(params: CoordinatorParams, state: JobState, request, now: float, effects: _Effects):
    if request.membership.version > state.membership.version:
        state = _recover(state, request, now, effects)
    elif (
        request.membership.version == state.membership.version
        and request.last_commit.commit_id > state.last_commit.commit_id
        and request.last_commit.membership_version == state.membership.version
    ):
        # Another worker of the recovered membership knows a later commit than the first reported.
        state = dataclasses.replace(state, last_commit=_copy(request.last_commit))
    existing = state.workers.get(request.worker_id)
    if existing is not None and existing.alive and _other_process(existing, request):
        # Its previous process is gone, and its state with it: remove that member now; the new
        # process joins like any new worker (at the back of the order, synced at a commit).
        effects.log(
            logging.WARNING,
            "worker %s restarted (a new process at %s): its previous process is gone",
            request.worker_id,
            request.address,
        )
        state = _with_workers(state, [dataclasses.replace(existing, alive=False)])
        state = _publish(params, state, now, effects, f"{request.worker_id} restarted", admit=False)
        existing = state.workers[request.worker_id]
    running = state.membership.version > 0 and state.membership.rank_of(request.worker_id) < 0
    if existing is not None and existing.alive:
        incarnation = existing.incarnation or request.incarnation
        renewed = dataclasses.replace(existing, last_heartbeat=now, reported=True, incarnation=incarnation)
        state = _with_workers(state, [renewed])
        join_order = existing.join_order
    else:
        join_order = state.joins + 1
        worker = Worker(
            request.worker_id, request.address, join_order, now, incarnation=request.incarnation, host=request.host
        )
        workers = {k: w for k, w in state.workers.items() if k != request.worker_id}
        workers[request.worker_id] = worker
        state = dataclasses.replace(state, workers=workers, joins=join_order)
        effects.log(
            logging.INFO, "worker %s registered from %s (join #%d)", request.worker_id, request.address, join_order
        )
        if state.membership.version > 0 and _ready(params, state.membership):
            effects.log(logging.INFO, "worker %s joins the running job at its next commit", request.worker_id)
        state = _publish(params, state, now, effects, f"{request.worker_id} joined", admit=False)
    response = coordinator_pb2.RegisterResponse(
        join_order=join_order,
        heartbeat_interval_s=params.worker_heartbeat_interval_s,
        joins_running_job=running,
    )
    return state, events.Reply(response)


def _recover(state: JobState, request, now: float, effects: _Effects) -> JobState:
    """Adopts the membership and last commit a worker reports (this coordinator restarted)."""
    membership = Membership.from_proto(request.membership)
    effects.log(
        logging.WARNING,
        "worker %s reports membership version %d (this coordinator is at %d): "
        "adopting it and its last commit #%d (coordinator restart)",
        request.worker_id,
        membership.version,
        state.membership.version,
        request.last_commit.commit_id,
    )
    joins = state.joins
    adopted = []
    for member in membership.members:
        known = state.workers.get(member.worker_id)
        if known is None or not known.alive:
            joins += 1
            reported = member.worker_id == request.worker_id
            adopted.append(Worker(member.worker_id, member.address, joins, now, True, reported, host=member.host))
    state = dataclasses.replace(_with_workers(state, adopted), joins=joins, membership=membership)
    if request.last_commit.commit_id > state.last_commit.commit_id:
        state = dataclasses.replace(state, last_commit=_copy(request.last_commit))
    effects.wake = True
    return state


def _on_poll(params: CoordinatorParams, state: JobState, event: events.Poll, now: float, effects: _Effects):
    """A long poll is answered once a membership after ``after_version`` holds the worker and has
    enough members, or when the job finished, the coordinator stops, the worker's process was
    replaced, or its time is up."""
    request = event.request
    if state.replaced(request.worker_id, request.incarnation):
        response = coordinator_pb2.GetMembershipResponse(membership=state.membership.to_proto(), replaced=True)
        return state, events.Reply(response)
    m = state.membership
    ready = m.version > request.after_version and m.rank_of(request.worker_id) >= 0 and _ready(params, m)
    if not (ready or event.waited_out or state.stopped or state.finished):
        return state, events.Wait()
    state, _ = _touch(state, request.worker_id, now)
    response = coordinator_pb2.GetMembershipResponse(
        membership=m.to_proto(),
        registered=state.live_count(),
        min_workers=params.counts.min_workers,
        max_workers=params.counts.max_workers,
        last_commit=state.last_commit,
        job_finished=state.finished,
    )
    return state, events.Reply(response)


def _on_poll_opened(params: CoordinatorParams, state: JobState, event: events.PollOpened, now: float, effects):
    polling = dict(state.polling)
    polling[event.worker_id] = polling.get(event.worker_id, 0) + 1
    return dataclasses.replace(state, polling=polling), None


def _on_poll_closed(params: CoordinatorParams, state: JobState, event: events.PollClosed, now: float, effects):
    polling = dict(state.polling)
    left = polling.pop(event.worker_id, 0) - 1
    if left > 0:
        polling[event.worker_id] = left
    return dataclasses.replace(state, polling=polling), None


def _on_heartbeat(params: CoordinatorParams, state: JobState, event: events.Heartbeat, now: float, effects):
    request = event.request
    version = state.membership.version
    if state.replaced(request.worker_id, request.incarnation):
        return state, events.Reply(coordinator_pb2.HeartbeatResponse(membership_version=version, replaced=True))
    state, alive = _touch(state, request.worker_id, now)
    known = alive and state.workers[request.worker_id].reported
    return state, events.Reply(coordinator_pb2.HeartbeatResponse(membership_version=version, known=known))


def _on_leave(params: CoordinatorParams, state: JobState, event: events.Leave, now: float, effects: _Effects):
    request = event.request
    if state.replaced(request.worker_id, request.incarnation):  # must not remove its successor
        effects.log(logging.INFO, "ignored the leave of worker %s's replaced process", request.worker_id)
        return state, _leave_response(state)
    if request.finished and not state.finished:
        effects.log(logging.INFO, "worker %s finished the job: workers waiting to join are released", request.worker_id)
        effects.wake = True
        state = dataclasses.replace(state, finished=True)
    worker = state.workers.get(request.worker_id)
    if worker is not None and worker.alive:
        effects.log(logging.INFO, "worker %s left: %s", request.worker_id, request.reason or "no reason given")
        state = _with_workers(state, [dataclasses.replace(worker, alive=False)])
        state = _publish(params, state, now, effects, f"{request.worker_id} left")
    return state, _leave_response(state)


def _leave_response(state: JobState) -> events.Reply:
    return events.Reply(coordinator_pb2.LeaveResponse(membership_version=state.membership.version))


def _on_report_failure(params: CoordinatorParams, state: JobState, event: events.ReportFailure, now: float, effects):
    """The suspects a report names are probed; those that do not answer are declared dead (not a
    process that registered under one's id meanwhile), as are those the reporter saw die (``dead``,
    unprobed: their host's kernel told it), and the members re-form: a new version,
    even with the same members. A report about another membership, or from a replaced process,
    changes nothing."""
    request = event.request
    response = events.Reply(coordinator_pb2.FailureReportResponse(membership_version=state.membership.version))
    if request.membership_version != state.membership.version or state.replaced(request.worker_id, request.incarnation):
        return state, response
    suspects = [state.workers[s] for s in request.suspects if s in state.workers]
    # No probe of one seen dead: it would only wait for the corpse. Life marks exist between workers
    # of one host only: a claim about another host's worker is probed like any suspect.
    reporter = state.workers.get(request.worker_id)
    dead = [w for w in suspects if w.worker_id in request.dead and reporter is not None and w.host == reporter.host]
    unsure = [w for w in suspects if w not in dead]
    if event.probed is None and unsure:
        return state, events.Probe(tuple(events.Target(w.worker_id, w.address, w.join_order) for w in unsure))
    probed = event.probed or {}
    silent = dead + [w for w in unsure if probed.get(w.join_order) is False]
    for w in silent:
        if w.alive and w in dead:
            seen_by = request.worker_id
            effects.log(logging.WARNING, "worker %s (%s) died, %s saw: declared dead", w.worker_id, w.address, seen_by)
        elif w.alive:
            effects.log(logging.WARNING, "worker %s (%s) does not answer: declared dead", w.worker_id, w.address)
    state = _with_workers(state, [dataclasses.replace(w, alive=False) for w in silent if w.alive])
    names = ", ".join(w.worker_id for w in silent)
    reason = f"{request.worker_id} reported: {request.reason}" + (f"; {names} unreachable" if names else "")
    state = _publish(params, state, now, effects, reason, force=True)
    return state, events.Reply(coordinator_pb2.FailureReportResponse(membership_version=state.membership.version))


def _on_commit(params: CoordinatorParams, state: JobState, event: events.Commit, now: float, effects: _Effects):
    """Records the commit every member of ``membership_version`` agreed on, sent by one of them
    (rank 0); ``leaving_workers`` leave the job here, and waiting workers join. Not recorded when
    the membership changed since (a member failed: all roll back); a leaver that is not a member is
    refused (``INVALID_ARGUMENT``)."""
    request = event.request
    if state.replaced(request.worker_id, request.incarnation):
        return state, _commit_answer(state, False, "a newer process registered under this worker id")
    state, _ = _touch(state, request.worker_id, now)
    last = state.last_commit
    if last.commit_id == request.commit_id and last.membership_version == request.membership_version:
        return state, _commit_answer(state, True, "recorded")  # a retry whose answer was lost
    m = state.membership
    if request.membership_version != m.version or m.rank_of(request.worker_id) < 0:
        return state, _commit_answer(state, False, f"membership changed to version {m.version} ({m.reason})")
    strangers = sorted(w for w in set(request.leaving_workers) if m.rank_of(w) < 0)
    if strangers:
        message = f"{strangers} leave at commit #{request.commit_id} but are not members of version {m.version}"
        return state, events.Refuse(grpc.StatusCode.INVALID_ARGUMENT, message)
    record = coordinator_pb2.CommitRecord(
        commit_id=request.commit_id, membership_version=request.membership_version, position=request.position
    )
    leaving = sorted(set(request.leaving_workers))
    state = _with_workers(state, [dataclasses.replace(state.workers[w], alive=False) for w in leaving])
    state = dataclasses.replace(state, last_commit=record)
    reason = f"{', '.join(leaving)} left gracefully at commit #{request.commit_id}" if leaving else ""
    state = _publish(params, state, now, effects, reason or f"workers joined at commit #{request.commit_id}")
    effects.wake = True
    return state, _commit_answer(state, True, "recorded")


def _commit_answer(state: JobState, recorded: bool, reason: str) -> events.Reply:
    return events.Reply(
        coordinator_pb2.CommitResponse(recorded=recorded, membership_version=state.membership.version, reason=reason)
    )


def _copy(record: coordinator_pb2.CommitRecord) -> coordinator_pb2.CommitRecord:
    """A record of the state's own: a request's message is its caller's to change."""
    return coordinator_pb2.CommitRecord.FromString(record.SerializeToString())


_HANDLERS: Dict[type, Handler] = {
    events.Register: _on_register,
    events.Poll: _on_poll,
    events.PollOpened: _on_poll_opened,
    events.PollClosed: _on_poll_closed,
    events.Heartbeat: _on_heartbeat,
    events.Leave: _on_leave,
    events.ReportFailure: _on_report_failure,
    events.Commit: _on_commit,
    events.Tick: _on_tick,
    events.Stop: _on_stop,
}


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
