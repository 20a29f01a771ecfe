"""The coordinator's decisions as pure functions: no gRPC, no threads, no clock."""

import copy
import logging

import grpc
from hypothesis import example, given, settings
from hypothesis import strategies as st

from elasticdl_strategy.coordinator import CoordinatorParams, WorkerCounts, events
from elasticdl_strategy.coordinator.state import JobState
from elasticdl_strategy.coordinator.transitions import transition
from elasticdl_strategy.transport.protos import coordinator_pb2 as pb

PARAMS = CoordinatorParams(WorkerCounts.of(3, min_workers=2, max_workers=4), heartbeat_timeout_s=5, last_call_s=2)


def step(state, event, now=0.0, params=PARAMS):
    """Applies ``event``, checking that the state it was applied to did not change."""
    before = copy.deepcopy(state)
    result = transition(params, state, event, now)
    assert state == before, f"{event} changed the state it was given"
    return result


def registered(*worker_ids, now=0.0, params=PARAMS):
    state = JobState()
    for worker_id in worker_ids:
        request = pb.RegisterRequest(worker_id=worker_id, address=f"h:{worker_id}", incarnation="first")
        state = step(state, events.Register(request), now, params).state
    return state


def lines(result, level=None):
    """The lines a transition asks to log (at ``level``, if given)."""
    return [message % args for at, message, args in result.logs if level is None or at == level]


def member_processes(state):
    """The members as processes: (worker id, join order)."""
    return [(w, state.workers[w].join_order) for w in ids(state)]


def ids(state):
    return [m.worker_id for m in state.membership.members]


def test_forming_publishes_once_with_a_log_line_and_a_wake_up():
    state = registered("a", "b")
    assert state.membership.version == 0 and state.min_reached_at == 0.0
    third = step(state, events.Register(pb.RegisterRequest(worker_id="c", address="h:c")), now=1.0)
    assert ids(third.state) == ["a", "b", "c"] and third.state.membership.version == 1
    assert third.wake and lines(third)[-1] == "membership version 0 -> 1 (formed): [] -> ['a', 'b', 'c']"
    assert third.answer.response.join_order == 3 and not third.answer.response.joins_running_job


def test_the_last_call_is_a_matter_of_time_passed():
    state = registered("a", "b")
    assert step(state, events.Tick(), now=1.9).state.membership.version == 0
    late = step(state, events.Tick(), now=2.0)
    assert ids(late.state) == ["a", "b"] and "after the last call" in late.state.membership.reason


def test_a_heartbeat_changes_no_membership_and_wakes_nobody():
    state = registered("a", "b", "c")
    beat = step(state, events.Heartbeat(pb.HeartbeatRequest(worker_id="b")), now=4.0)
    assert beat.answer.response.known and beat.state.workers["b"].last_heartbeat == 4.0
    assert not beat.wake and not beat.logs and beat.state.membership is state.membership


def test_silence_kills_but_a_waiting_long_poll_keeps_a_worker_alive():
    state = registered("a", "b", "c")
    state = step(state, events.PollOpened("b")).state
    tick = step(state, events.Tick(), now=5.5)
    assert ids(tick.state) == ["b"] and tick.state.membership.version == 2
    assert [line.split(" (")[0] for line in lines(tick, logging.WARNING)] == ["worker a", "worker c"]
    state = step(tick.state, events.PollClosed("b")).state
    assert not state.polling
    assert step(state, events.Tick(), now=11.0).state.membership.size == 0


def test_a_long_poll_waits_until_a_newer_membership_holds_the_worker():
    state = registered("a", "b")
    poll = events.Poll(pb.GetMembershipRequest(worker_id="a", after_version=0))
    assert isinstance(step(state, poll).answer, events.Wait)
    assert step(state, events.Poll(poll.request, waited_out=True)).answer.response.membership.version == 0
    state = step(state, events.Register(pb.RegisterRequest(worker_id="c", address="h:c"))).state
    answer = step(state, poll, now=3.0)
    assert answer.answer.response.membership.version == 1 and answer.state.workers["a"].last_heartbeat == 3.0


def test_a_second_process_under_a_live_id_is_probed_then_refused_or_taken_for_a_restart():
    state = registered("a", "b", "c")
    second = events.Register(pb.RegisterRequest(worker_id="b", address="elsewhere:1", incarnation="second"))
    probe = step(state, second)
    assert probe.answer == events.Probe((events.Target("b", "h:b", 2),)) and probe.state is state
    refused = step(state, events.Register(second.request, {2: True}))
    assert refused.answer.code == grpc.StatusCode.ALREADY_EXISTS and refused.state is state
    restart = step(state, events.Register(second.request, {2: False}), now=1.0)
    assert ids(restart.state) == ["a", "c"] and "b restarted" in restart.state.membership.reason
    assert restart.state.workers["b"].join_order == 4 and restart.answer.response.joins_running_job


def test_a_probe_about_an_earlier_process_is_not_applied_to_a_later_one():
    state = registered("a", "b", "c")
    report = events.ReportFailure(pb.FailureReport(worker_id="a", membership_version=1, suspects=["c"], reason="x"))
    probe = step(state, report).answer
    assert probe.targets == (events.Target("c", "h:c", 3),)
    # c restarts in place meanwhile: a new process, join #4, at the same address
    restarted = pb.RegisterRequest(worker_id="c", address="h:c", incarnation="second")
    state = step(state, events.Register(restarted)).state
    after = step(state, events.ReportFailure(report.request, {3: False}))
    assert after.state.workers["c"].alive and after.state.workers["c"].join_order == 4
    # the same answer about the process it was asked about declares it dead
    state = registered("a", "b", "c")
    after = step(state, events.ReportFailure(report.request, {3: False}))
    assert ids(after.state) == ["a", "b"] and "c unreachable" in after.state.membership.reason


def test_a_suspect_the_reporter_saw_die_is_declared_dead_without_a_probe():
    state = registered("a", "b", "c", "d")
    report = pb.FailureReport(worker_id="a", membership_version=1, suspects=["b", "c"], dead=["c"], reason="x")
    probe = step(state, events.ReportFailure(report)).answer
    assert probe.targets == (events.Target("b", "h:b", 2),)  # only the one it could not reach
    after = step(state, events.ReportFailure(report, {2: True}))
    assert ids(after.state) == ["a", "b", "d"] and "c unreachable" in after.state.membership.reason
    alone = pb.FailureReport(worker_id="a", membership_version=1, suspects=["c"], dead=["c"], reason="x")
    after = step(state, events.ReportFailure(alone))  # nothing to probe: decided at once
    assert ids(after.state) == ["a", "b", "d"] and after.state.membership.version == 2


def test_a_death_claimed_about_a_worker_of_another_host_is_probed():
    state = JobState()
    for worker_id, host in (("a", "h1"), ("b", "h1"), ("c", "h2")):
        request = pb.RegisterRequest(worker_id=worker_id, address=f"{host}:{worker_id}", incarnation="1", host=host)
        state = step(state, events.Register(request)).state
    report = pb.FailureReport(worker_id="a", membership_version=1, suspects=["b", "c"], dead=["b", "c"], reason="x")
    probe = step(state, events.ReportFailure(report)).answer  # life marks only exist within a host
    assert probe.targets == (events.Target("c", "h2:c", 3),)
    after = step(state, events.ReportFailure(report, {3: True}))
    assert ids(after.state) == ["a", "c"]


def test_a_report_whose_suspects_all_answer_still_re_forms_the_members():
    state = registered("a", "b", "c")
    report = pb.FailureReport(worker_id="a", membership_version=1, suspects=["c"], reason="timeout")
    after = step(state, events.ReportFailure(report, {3: True}))
    assert ids(after.state) == ["a", "b", "c"] and after.state.membership.version == 2 and after.wake


def test_a_commit_admits_joiners_and_removes_leavers_in_one_version():
    state = registered("a", "b", "c", "d", "e")  # d and e wait: the membership formed at 3
    assert ids(state) == ["a", "b", "c"]
    commit = pb.CommitRequest(worker_id="a", membership_version=1, commit_id=1, leaving_workers=["b"])
    after = step(state, events.Commit(commit), now=1.0)
    assert after.answer.response.recorded and after.state.last_commit.commit_id == 1
    assert ids(after.state) == ["a", "c", "d", "e"] and after.state.membership.version == 2
    stranger = pb.CommitRequest(worker_id="a", membership_version=2, commit_id=2, leaving_workers=["zed"])
    refused = step(after.state, events.Commit(stranger))
    assert refused.answer.code == grpc.StatusCode.INVALID_ARGUMENT and refused.state.last_commit.commit_id == 1


def test_a_worker_reporting_a_newer_membership_is_adopted_with_its_commit():
    known = pb.Membership(version=7, members=[pb.Member(worker_id=w, address=f"h:{w}") for w in "ab"])
    last = pb.CommitRecord(commit_id=12, membership_version=7)
    request = pb.RegisterRequest(worker_id="b", address="h:b", membership=known, last_commit=last)
    after = step(JobState(), events.Register(request))
    assert ids(after.state) == ["a", "b"] and after.state.membership.version == 7 and after.wake
    assert after.state.last_commit.commit_id == 12 and not after.state.workers["a"].reported
    last.commit_id = 99  # the request's message is its caller's: the state keeps its own record
    assert after.state.last_commit.commit_id == 12


# Random histories: every transition leaves its input alone (checked by step) and the published
# membership keeps its invariants whatever happens in between.
WORKERS = ["a", "b", "c", "d", "e"]
_event = st.one_of(
    st.builds(
        lambda w, inc: events.Register(pb.RegisterRequest(worker_id=w, address=f"h:{w}", incarnation=inc)),
        st.sampled_from(WORKERS),
        st.sampled_from(["first", "second"]),
    ),
    st.builds(lambda w: events.Heartbeat(pb.HeartbeatRequest(worker_id=w)), st.sampled_from(WORKERS)),
    st.builds(lambda w: events.Leave(pb.LeaveRequest(worker_id=w)), st.sampled_from(WORKERS)),
    st.builds(lambda w: events.PollOpened(w), st.sampled_from(WORKERS)),
    st.builds(lambda w: events.PollClosed(w), st.sampled_from(WORKERS)),
    st.just(events.Tick()),
    st.builds(lambda w, gone: ("report", w, gone), st.sampled_from(WORKERS), st.sampled_from(WORKERS)),
    st.builds(lambda leaving: ("commit", leaving), st.lists(st.sampled_from(WORKERS), max_size=2)),
)


def _register(worker_id, incarnation):
    request = pb.RegisterRequest(worker_id=worker_id, address=f"h:{worker_id}", incarnation=incarnation)
    return events.Register(request)


@settings(max_examples=150, deadline=None)
@given(history=st.lists(st.tuples(_event, st.floats(0, 4)), max_size=40))
@example(  # two members restart in place: the second one's registration publishes twice
    history=[(_register(w, i), 0.0) for w, i in ["a1", "b1", "c1", "a2", "b2"]]
)
def test_memberships_keep_their_invariants_through_any_history(history):
    state, now, commits = JobState(), 0.0, 0
    for event, elapsed in history:
        now += elapsed
        if isinstance(event, tuple) and event[0] == "report":  # a member reports another as unreachable
            _, reporter, suspect = event
            report = pb.FailureReport(
                worker_id=reporter, membership_version=state.membership.version, suspects=[suspect]
            )
            event = events.ReportFailure(report, {w.join_order: False for w in state.workers.values()})
        elif isinstance(event, tuple):  # rank 0 commits for the members
            if not state.membership.size:
                continue
            commits += 1
            leaving = [w for w in event[1] if state.membership.rank_of(w) >= 0]
            event = events.Commit(
                pb.CommitRequest(
                    worker_id=ids(state)[0],
                    membership_version=state.membership.version,
                    commit_id=commits,
                    leaving_workers=leaving,
                )
            )
        before = state
        after = step(state, event, now)
        state = after.state
        m = state.membership
        assert m.version >= before.membership.version
        assert (m.version > before.membership.version) == (m is not before.membership)
        if m is not before.membership:
            assert after.wake, f"{event} published without waking the waiters"
        assert len(set(ids(state))) == m.size <= PARAMS.counts.max_workers
        if not state.finished:
            assert all(state.workers[w].alive for w in ids(state)), "a dead worker in the published membership"
        # Survivors are processes: a worker id whose process restarted joins again at the back.
        processes_before, processes = member_processes(before), member_processes(state)
        survivors = [p for p in processes_before if p in processes]
        assert processes[: len(survivors)] == survivors, "survivors changed their order"
