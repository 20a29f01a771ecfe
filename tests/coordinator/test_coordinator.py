"""Rendezvous: ranks by join order, formation, heartbeats, leaving, timeouts."""

import asyncio
import queue
import threading
import time

import grpc
import pytest

from elasticdl_strategy.coordinator import Coordinator, CoordinatorParams, WorkerCounts, events
from elasticdl_strategy.coordinator.client import CoordinatorClient
from elasticdl_strategy.coordinator.membership import Membership
from elasticdl_strategy.coordinator.server import CoordinatorServer
from elasticdl_strategy.coordinator.service import CoordinatorService, health_probe
from elasticdl_strategy.errors import ConfigError, RendezvousError, RendezvousTimeoutError, WorkerReplaced
from elasticdl_strategy.transport.auth import call_metadata, new_token
from elasticdl_strategy.transport.endpoints import open_aio_channel
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2 as pb
from elasticdl_strategy.transport.protos import coordinator_pb2_grpc as pb_grpc
from tests.conditions import wait_for


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Context:
    async def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")


class Direct:
    """A coordinator and its service, the service's methods called without gRPC, each in an event
    loop of its own (so that calls from several threads wait concurrently, as served calls do)."""

    def __init__(self, params, clock):
        self.core = Coordinator(params, clock=clock)
        self.probe = None  # a stand-in for the health probe: whether a worker at an address answers
        real_probe = health_probe(TransportOptions())

        async def probe(address):
            return await real_probe(address) if self.probe is None else self.probe(address)

        self._service = CoordinatorService(self.core, probe)

    def heartbeat(self, request):
        return self.core.handle(events.Heartbeat(request)).response

    def __getattr__(self, name):
        if name[0].isupper():  # an RPC
            method = getattr(self._service, name)
            return lambda request: asyncio.run(method(request, Context()))
        return getattr(self.core, name)


def register(coordinator, worker_id, address=None, incarnation="first"):
    request = pb.RegisterRequest(worker_id=worker_id, address=address or f"h:{worker_id}", incarnation=incarnation)
    return coordinator.Register(request)


def members(coordinator):
    return [m.worker_id for m in coordinator.membership.members]


def test_membership_forms_at_target_with_ranks_in_join_order():
    c = Direct(CoordinatorParams(WorkerCounts.of(3, min_workers=2)), clock=FakeClock())
    for wid in ["b", "a"]:
        register(c, wid)
    assert c.membership.version == 0  # 2 of 3, last call not over
    register(c, "c")
    assert c.membership.version == 1
    assert members(c) == ["b", "a", "c"]
    assert c.membership.rank_of("a") == 1


def test_last_call_forms_with_min_workers():
    clock = FakeClock()
    c = Direct(CoordinatorParams(WorkerCounts.of(4, min_workers=2), last_call_s=5), clock=clock)
    register(c, "a")
    register(c, "b")
    clock.now += 4
    c.reap()
    assert c.membership.version == 0
    clock.now += 2
    c.reap()
    assert c.membership.version == 1 and members(c) == ["a", "b"]


def test_missed_heartbeats_publish_a_new_version_without_the_dead_worker():
    clock = FakeClock()
    c = Direct(
        CoordinatorParams(WorkerCounts.of(3, min_workers=1), heartbeat_interval_s=1, heartbeat_timeout_s=5), clock=clock
    )
    for wid in "abc":
        register(c, wid)
    assert c.membership.version == 1
    clock.now += 4
    for wid in "ac":
        assert c.heartbeat(pb.HeartbeatRequest(worker_id=wid)).known
    clock.now += 2  # b silent for 6 s
    c.reap()
    assert c.membership.version == 2 and members(c) == ["a", "c"]
    assert "b missed heartbeats" in c.membership.reason
    assert not c.heartbeat(pb.HeartbeatRequest(worker_id="b")).known


def commit(coordinator, worker_id, commit_id, version=None, leaving=(), epoch=0):
    """A commit the members agreed on, sent by ``worker_id`` (rank 0) for all of them."""
    request = pb.CommitRequest(
        worker_id=worker_id,
        membership_version=coordinator.membership.version if version is None else version,
        commit_id=commit_id,
        position=pb.DataPosition(epoch=epoch),
        leaving_workers=list(leaving),
    )
    return coordinator.Commit(request)


def test_the_host_a_worker_registers_with_reaches_every_member_and_survives_a_restart():
    c = Direct(CoordinatorParams(WorkerCounts.of(3)), clock=FakeClock())
    for wid, host in (("a", "node-1"), ("b", "node-1"), ("c", "")):
        c.Register(pb.RegisterRequest(worker_id=wid, address=f"10.0.0.{ord(wid)}:7000", host=host))
    assert c.membership.hosts == ("node-1", "node-1", "10.0.0.99")  # c: its address's host
    restarted = Direct(CoordinatorParams(WorkerCounts.of(3)), clock=FakeClock())
    restarted.Register(pb.RegisterRequest(worker_id="c", address="10.0.0.99:7000", membership=c.membership.to_proto()))
    assert Membership.from_proto(restarted.membership.to_proto()).hosts == ("node-1", "node-1", "10.0.0.99")


def test_leave_and_rejoin_get_new_versions_and_the_back_of_the_order():
    c = Direct(CoordinatorParams(WorkerCounts.of(2, min_workers=1, max_workers=3)), clock=FakeClock())
    register(c, "a")
    register(c, "b")
    c.Leave(pb.LeaveRequest(worker_id="a", reason="done"))
    assert c.membership.version == 2 and members(c) == ["b"]
    response = register(c, "a")
    # b is training: a waits for b's next commit, so that both switch at the same step.
    assert response.joins_running_job and c.membership.version == 2
    assert commit(c, "b", 1).membership_version == 3
    assert members(c) == ["b", "a"]


def test_extra_workers_beyond_max_wait_as_standbys():
    c = Direct(CoordinatorParams(WorkerCounts.of(2, min_workers=1)), clock=FakeClock())
    for wid in "abc":
        register(c, wid)
    assert members(c) == ["a", "b"]
    c.Leave(pb.LeaveRequest(worker_id="a"))
    assert members(c) == ["b", "c"]


def test_same_id_from_another_address_is_refused_while_the_first_process_answers(monkeypatch):
    c = Direct(CoordinatorParams(WorkerCounts.of(2, min_workers=1)), clock=FakeClock())
    register(c, "a", "h:1")
    register(c, "a", "h:1")  # a retry is fine
    monkeypatch.setattr(c, "probe", lambda address: True)
    for incarnation in ("second", ""):  # another process, or a client that does not say
        with pytest.raises(grpc.RpcError, match="already used by a live process at h:1"):
            register(c, "a", "h:2", incarnation=incarnation)


def test_a_restarted_process_under_a_members_id_replaces_it_and_joins_like_a_new_worker():
    c = Direct(CoordinatorParams(WorkerCounts.of(3, min_workers=2)), clock=FakeClock())
    for wid in "abc":
        register(c, wid)
    assert c.membership.version == 1 and members(c) == ["a", "b", "c"]
    # "a" restarts in place (same address, e.g. a container restarted by its operator): its old
    # process and state are gone; the new one must not take rank 0 and hand out fresh weights.
    response = register(c, "a", incarnation="second")
    assert c.membership.version == 2 and members(c) == ["b", "c"]
    assert "a restarted" in c.membership.reason
    assert response.joins_running_job and response.join_order == 4  # at the back, synced at a commit
    response = commit(c, "b", 1, version=2)  # b and c agreed on it
    assert response.recorded and response.membership_version == 3  # the newcomer joins there
    assert members(c) == ["b", "c", "a"]
    # A retry from the same process changes nothing.
    assert register(c, "a", incarnation="second").join_order == 4 and c.membership.version == 3


def test_a_new_process_elsewhere_under_a_live_workers_id_is_refused_while_the_old_one_answers(monkeypatch):
    c = Direct(CoordinatorParams(WorkerCounts.of(1)), clock=FakeClock())
    register(c, "a", "h:1")
    monkeypatch.setattr(c, "probe", lambda address: address == "h:1")  # the old process answers health checks
    with pytest.raises(grpc.RpcError, match="already used by a live process at h:1"):
        register(c, "a", "h:2", incarnation="second")
    assert members(c) == ["a"] and c.membership.version == 1
    monkeypatch.setattr(c, "probe", lambda address: False)  # it died (a relaunched pod, new address)
    assert register(c, "a", "h:2", incarnation="second").join_order == 2
    assert c.membership.version == 3 and [m.address for m in c.membership.members] == ["h:2"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"heartbeat_interval_s": 5, "heartbeat_timeout_s": 2}, "heartbeat_interval_s=5"),
        ({"last_call_s": -1}, "last_call_s=-1"),
    ],
)
def test_invalid_params_name_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CoordinatorParams(**kwargs)


@pytest.fixture
def served():
    token = new_token()
    server = CoordinatorServer(
        CoordinatorParams(WorkerCounts.of(2), heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5),
        "127.0.0.1:0",
        token,
        TransportOptions(),
    )
    yield server, token
    server.stop(0)


def test_clients_rendezvous_over_grpc_and_a_silent_worker_is_dropped(served):
    server, token = served
    address = f"127.0.0.1:{server.port}"
    clients = [CoordinatorClient(address, f"w{i}", token, TransportOptions()) for i in range(2)]
    try:
        results = [None, None]

        def join(i):
            clients[i].register(f"127.0.0.1:{1000 + i}", timeout=5)
            results[i] = clients[i].wait_for_membership(0, timeout=10)

        threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert results[0] == results[1] and results[0].version == 1 and results[0].size == 2
        versions = []
        clients[0].start_heartbeats(lambda: 1, lambda response: versions.append(response.membership_version))
        # w1 stays silent: dropped in version 2. Below min_workers=2, w0 is told to keep waiting.
        with pytest.raises(RendezvousTimeoutError, match="1 worker\\(s\\) registered, at least 2 needed"):
            clients[0].wait_for_membership(1, timeout=2)
        assert 2 in versions
        assert [m.worker_id for m in server.coordinator.membership.members] == ["w0"]
    finally:
        for c in clients:
            c.close()


def test_waiting_for_min_workers_times_out_with_a_clear_error(served):
    server, token = served
    client = CoordinatorClient(f"127.0.0.1:{server.port}", "lonely", token, TransportOptions())
    try:
        client.register("127.0.0.1:1", timeout=5)
        start = time.monotonic()
        # Longer than the heartbeat timeout: waiting keeps the worker registered.
        with pytest.raises(RendezvousTimeoutError, match="1 worker\\(s\\) registered, at least 2 needed"):
            client.wait_for_membership(0, timeout=1.5)
        assert time.monotonic() - start < 5
    finally:
        client.close()


def test_a_stoppable_wait_long_polls_and_interrupt_wait_ends_it_at_once(served, monkeypatch):
    # Waiting with a stop() must not cost a poll a second per worker (1,000 workers, 1,000 calls a
    # second): stop() is checked when interrupt_wait() is called instead.
    server, token = served
    polls = []
    handle = server.coordinator.handle

    def counting(event):
        if isinstance(event, events.PollOpened):
            polls.append(event)
        return handle(event)

    monkeypatch.setattr(server.coordinator, "handle", counting)
    client = CoordinatorClient(f"127.0.0.1:{server.port}", "lonely", token, TransportOptions())
    client.start_heartbeats(lambda: 0, lambda response: None)  # stays registered while it waits
    stopped, results = threading.Event(), []
    waiting = threading.Thread(target=lambda: results.append(client.wait_for_membership(0, 60, stopped.is_set)))
    try:
        client.register("127.0.0.1:1", timeout=5)
        waiting.start()
        wait_for(lambda: polls, "the first poll", 5)
        time.sleep(2.5)  # the window in which a polling wait would have asked again
        assert len(polls) == 1
        stopped.set()
        client.interrupt_wait()
        started = time.monotonic()
        waiting.join(5)
        assert results == [None] and time.monotonic() - started < 1.0
    finally:
        stopped.set()
        client.interrupt_wait()
        waiting.join(5)
        client.close()


def test_unreachable_coordinator_is_a_rendezvous_error():
    client = CoordinatorClient("127.0.0.1:1", "w", new_token(), TransportOptions())
    try:
        with pytest.raises(RendezvousError, match="cannot reach the coordinator"):
            client.register("127.0.0.1:2", timeout=1.0)
    finally:
        client.close()


# ---- commits, failures, data, recovery ----------------------------------------------------------


def in_thread(fn, *args, **kwargs):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, result


def test_a_commit_one_member_sends_is_recorded_for_all_and_a_retry_says_so():
    c = Direct(CoordinatorParams(WorkerCounts.of(2)), clock=FakeClock())
    register(c, "a")
    register(c, "b")
    response = commit(c, "a", 1, epoch=2)
    assert response.recorded and response.membership_version == 1
    assert c.last_commit.commit_id == 1 and c.last_commit.membership_version == 1 and c.last_commit.position.epoch == 2
    assert commit(c, "a", 1, epoch=2).recorded  # a retry of a recorded commit says so


def test_a_commit_from_a_stranger_or_of_an_old_membership_is_not_recorded():
    c = Direct(CoordinatorParams(WorkerCounts.of(2, min_workers=1)), clock=FakeClock())
    for wid in "abc":
        register(c, wid)  # c: a standby
    assert not commit(c, "c", 1).recorded
    c.Leave(pb.LeaveRequest(worker_id="b"))  # version 2: a and c
    response = commit(c, "a", 1, version=1)
    assert not response.recorded and response.membership_version == 2 and "b left" in response.reason
    assert c.last_commit.commit_id == 0


def test_a_member_dying_before_the_commit_arrives_aborts_it():
    clock = FakeClock()
    c = Direct(
        CoordinatorParams(WorkerCounts.of(2, min_workers=1), heartbeat_interval_s=1, heartbeat_timeout_s=5), clock=clock
    )
    register(c, "a")
    register(c, "b")
    clock.now += 6
    c.heartbeat(pb.HeartbeatRequest(worker_id="a"))
    c.reap()  # b is silent: declared dead, version 2
    response = commit(c, "a", 1, version=1)  # the members had agreed on it before b died
    assert not response.recorded and response.membership_version == 2
    assert c.last_commit.commit_id == 0 and members(c) == ["a"]


def test_workers_leaving_at_a_commit_are_removed_when_it_is_recorded():
    c = Direct(CoordinatorParams(WorkerCounts.of(3, min_workers=1)), clock=FakeClock())
    for wid in "abc":
        register(c, wid)
    response = commit(c, "a", 4, leaving=["b"])
    assert response.recorded and response.membership_version == 2
    assert members(c) == ["a", "c"] and "b left gracefully at commit #4" in c.membership.reason


def test_a_commit_naming_a_leaver_that_is_not_a_member_is_refused():
    c = Direct(CoordinatorParams(WorkerCounts.of(2)), clock=FakeClock())
    register(c, "a")
    register(c, "b")
    with pytest.raises(grpc.RpcError, match=r"\['x'\] leave at commit #1 but are not members"):
        commit(c, "a", 1, leaving=["b", "x"])
    assert c.last_commit.commit_id == 0 and members(c) == ["a", "b"]


def test_a_reported_peer_that_does_not_answer_is_removed():
    c = Direct(CoordinatorParams(WorkerCounts.of(2, min_workers=1)), clock=FakeClock())
    with socket_port() as port:
        register(c, "a")
        register(c, "b", f"127.0.0.1:{port}")  # nothing serves there
        c.ReportFailure(pb.FailureReport(worker_id="a", membership_version=1, suspects=["b"], reason="x"))
    assert members(c) == ["a"] and c.membership.version == 2
    # A report about an old membership changes nothing.
    c.ReportFailure(pb.FailureReport(worker_id="a", membership_version=1, suspects=["a"], reason="x"))
    assert c.membership.version == 2


def test_the_reports_of_every_survivor_about_one_suspect_make_one_health_check():
    c = Coordinator(CoordinatorParams(WorkerCounts.of(50, min_workers=1)), clock=FakeClock())
    for i in range(50):
        c.handle(events.Register(pb.RegisterRequest(worker_id=f"w{i}", address=f"h:{i}", incarnation="first")))
    probed = []

    async def probe(address):
        probed.append(address)
        await asyncio.sleep(0.05)  # the check takes a while: the other reports arrive meanwhile
        return False

    service = CoordinatorService(c, probe)

    async def everyone_reports():
        reports = [
            pb.FailureReport(worker_id=f"w{i}", membership_version=1, suspects=["w49"], incarnation="first")
            for i in range(49)
        ]
        return await asyncio.gather(*(service.ReportFailure(r, Context()) for r in reports))

    answers = asyncio.run(everyone_reports())
    assert probed == ["h:49"]
    assert c.membership.version == 2 and "w49" not in members(c) and len(members(c)) == 49
    assert {a.membership_version for a in answers} == {2}


def test_a_large_membership_change_is_logged_by_count_and_by_who_left(caplog):
    c = Coordinator(CoordinatorParams(WorkerCounts.of(40, min_workers=1)), clock=FakeClock())
    for i in range(40):
        c.handle(events.Register(pb.RegisterRequest(worker_id=f"w{i}", address=f"h:{i}", incarnation="first")))
    with caplog.at_level("INFO", logger="elasticdl_strategy.coordinator.coordinator"):
        c.handle(events.Leave(pb.LeaveRequest(worker_id="w7", reason="done", incarnation="first")))
    (line,) = [r.getMessage() for r in caplog.records if "membership version" in r.getMessage()]
    assert line.endswith("40 -> 39 members; left: w7"), line


def test_every_answer_holds_its_own_copy_of_the_membership():
    c = Coordinator(CoordinatorParams(WorkerCounts.of(2)), clock=FakeClock())
    for wid in "ab":
        c.handle(events.Register(pb.RegisterRequest(worker_id=wid, address=f"h:{wid}")))
    first = c.handle(events.Poll(pb.GetMembershipRequest(worker_id="a"))).response
    first.membership.members[0].address = "changed by its reader"
    second = c.handle(events.Poll(pb.GetMembershipRequest(worker_id="b"))).response
    assert second.membership.members[0].address == "h:a"


def test_a_process_that_registers_while_its_predecessor_is_probed_is_not_declared_dead():
    c = Direct(CoordinatorParams(WorkerCounts.of(2, min_workers=1)), clock=FakeClock())
    for wid in "abs":
        register(c, wid)  # s: a standby
    assert members(c) == ["a", "b"]

    def probe(address):  # while the old standby is probed, it restarts (a new process, same address)
        c.core.handle(events.Register(pb.RegisterRequest(worker_id="s", address="h:s", incarnation="second")))
        return False

    c.probe = probe
    c.ReportFailure(pb.FailureReport(worker_id="a", membership_version=1, suspects=["s"], reason="x"))
    assert c.heartbeat(pb.HeartbeatRequest(worker_id="s", incarnation="second")).known


def test_the_dataset_is_registered_once_and_shards_differ_per_epoch():
    c = Direct(CoordinatorParams(WorkerCounts.of(1)), clock=FakeClock())
    spec = pb.DatasetSpec(num_records=100, shard_size=10, seed=1, shuffle=True)
    first = c.GetShards(pb.GetShardsRequest(worker_id="a", spec=spec, epoch=0))
    again = c.GetShards(pb.GetShardsRequest(worker_id="b", spec=spec, epoch=0))
    other = c.GetShards(pb.GetShardsRequest(worker_id="b", spec=spec, epoch=1))
    assert list(first.starts) == list(again.starts) and list(first.starts) != list(other.starts)
    assert sorted(first.starts) == list(range(0, 100, 10))
    different = pb.DatasetSpec(num_records=99, shard_size=10, seed=1, shuffle=True)
    with pytest.raises(grpc.RpcError, match="differs from the job's"):
        c.GetShards(pb.GetShardsRequest(worker_id="c", spec=different, epoch=0))
    other_files = pb.DatasetSpec(num_records=100, shard_size=10, seed=1, shuffle=True, fingerprint="2 files: ab")
    with pytest.raises(grpc.RpcError, match="fingerprint='2 files: ab'.* differs from the job's"):
        c.GetShards(pb.GetShardsRequest(worker_id="c", spec=other_files, epoch=0))


def test_a_restarted_coordinator_adopts_the_membership_and_commit_workers_report():
    c = Direct(CoordinatorParams(WorkerCounts.of(2)), clock=FakeClock())
    known = pb.Membership(version=7, members=[pb.Member(worker_id=w, address=f"h:{w}") for w in "ab"])
    last = pb.CommitRecord(commit_id=12, membership_version=7, position=pb.DataPosition(epoch=1, cursor=40))
    request = pb.RegisterRequest(worker_id="b", address="h:b", membership=known, last_commit=last)
    response = c.Register(request)
    assert not response.joins_running_job
    assert c.membership.version == 7 and members(c) == ["a", "b"]
    assert c.last_commit.commit_id == 12 and c.last_commit.position.cursor == 40
    assert commit(c, "a", 12, version=7).recorded  # a member whose reply was lost learns it
    # a, adopted from b's report, is asked to register itself (its heartbeat is "unknown") ...
    assert not c.heartbeat(pb.HeartbeatRequest(worker_id="a", membership_version=7)).known
    # ... and when it knows a later commit of the same membership, the newest wins.
    later = pb.CommitRecord(commit_id=13, membership_version=7, position=pb.DataPosition(epoch=1, cursor=48))
    c.Register(pb.RegisterRequest(worker_id="a", address="h:a", membership=known, last_commit=later))
    assert c.last_commit.commit_id == 13
    assert c.heartbeat(pb.HeartbeatRequest(worker_id="a", membership_version=7)).known


def test_a_finished_job_releases_standbys():
    c = Direct(CoordinatorParams(WorkerCounts.of(1)), clock=FakeClock())
    register(c, "a")
    register(c, "standby")
    c.Leave(pb.LeaveRequest(worker_id="a", reason="finished", finished=True))
    response = c.GetMembership(pb.GetMembershipRequest(worker_id="standby", after_version=0, wait_s=5))
    assert response.job_finished and members(c) == ["a"]


class socket_port:
    """A local port that nothing listens on, for as long as the context lasts."""

    def __enter__(self):
        import socket

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        return self._socket.getsockname()[1]

    def __exit__(self, *exc):
        self._socket.close()


def test_waiting_long_polls_of_many_workers_hold_no_thread_and_heartbeats_go_on():
    # 80 workers, each on a connection of its own as from 80 worker processes, wait for the next
    # membership as coroutines, a heartbeat is answered at once meanwhile, and a commit at which
    # one of them leaves answers them all.
    n = 80
    token = new_token()
    params = CoordinatorParams(WorkerCounts.of(n, min_workers=1), heartbeat_interval_s=1, heartbeat_timeout_s=30)
    server = CoordinatorServer(params, "127.0.0.1:0", token, TransportOptions())
    metadata = call_metadata(token)

    async def main():
        channels = [open_aio_channel(f"127.0.0.1:{server.port}", TransportOptions()) for _ in range(n)]
        stubs = [pb_grpc.CoordinatorStub(channel) for channel in channels]
        try:
            for i, stub in enumerate(stubs):
                request = pb.RegisterRequest(worker_id=f"w{i}", address=f"h:{i}")
                await stub.Register(request, metadata=metadata, timeout=5)
            version = server.coordinator.membership.version
            assert server.coordinator.membership.size == n

            def poll(i):
                request = pb.GetMembershipRequest(worker_id=f"w{i}", after_version=version, wait_s=20)
                return stubs[i].GetMembership(request, metadata=metadata, timeout=25)

            threads = threading.active_count()
            waiting = [asyncio.ensure_future(poll(i)) for i in range(n - 1)]
            await wait_until(lambda: sum(server.coordinator.state.polling.values()) == n - 1)
            assert threading.active_count() <= threads + 2  # not one per waiting call
            heartbeats = stubs[0].Heartbeats(metadata=metadata, timeout=5)
            await heartbeats.write(pb.HeartbeatRequest(worker_id="w0"))
            beat = await asyncio.wait_for(heartbeats.read(), 1)
            assert beat.known and not any(call.done() for call in waiting)
            await heartbeats.done_writing()
            request = pb.CommitRequest(
                worker_id="w0", membership_version=version, commit_id=1, leaving_workers=[f"w{n - 1}"]
            )
            assert (await stubs[0].Commit(request, metadata=metadata, timeout=5)).recorded
            answers = await asyncio.gather(*waiting)
            assert all(a.membership.version == version + 1 and len(a.membership.members) == n - 1 for a in answers)
        finally:
            for channel in channels:
                await channel.close()

    try:
        asyncio.run(main())
    finally:
        server.stop(0)


async def wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_replaced_process_is_told_to_stop_and_cannot_keep_its_successor_alive():
    clock = FakeClock()
    c = Direct(
        CoordinatorParams(WorkerCounts.of(2, min_workers=1), heartbeat_interval_s=1, heartbeat_timeout_s=5), clock=clock
    )
    register(c, "a", incarnation="first")
    register(c, "b", incarnation="first")
    register(c, "a", "h:new", incarnation="second")  # the old "a" hung, a new process took its id
    old = c.heartbeat(pb.HeartbeatRequest(worker_id="a", incarnation="first"))
    assert old.replaced and not old.known
    waiting = c.GetMembership(pb.GetMembershipRequest(worker_id="a", incarnation="first", wait_s=30))
    assert waiting.replaced  # at once: the old process must not wait for, or be handed, a membership
    clock.now += 6  # only the old process "heartbeats": the new one is declared dead, not kept alive by it
    c.heartbeat(pb.HeartbeatRequest(worker_id="b", incarnation="first"))
    c.reap()
    assert "a" not in members(c)
    new = c.heartbeat(pb.HeartbeatRequest(worker_id="b", incarnation="first"))
    assert new.known and not new.replaced


def test_a_client_whose_id_was_taken_by_a_new_process_raises_worker_replaced(served):
    server, token = served
    address = f"127.0.0.1:{server.port}"
    old, new = (CoordinatorClient(address, "w0", token, TransportOptions()) for _ in range(2))
    try:
        old.register("127.0.0.1:1", timeout=5)
        new.register("127.0.0.1:1", timeout=5)  # same address: a restart in place
        answers = {client: queue.Queue() for client in (old, new)}
        for client, answered in answers.items():
            client.heartbeat_interval_s = 0.05
            client.start_heartbeats(lambda: 0, answered.put)
        assert answers[old].get(timeout=5).replaced and not answers[new].get(timeout=5).replaced
        with pytest.raises(WorkerReplaced, match="a new process registered under this worker id"):
            old.wait_for_membership(0, timeout=5)
    finally:
        old.close()
        new.close()


def test_a_replaced_process_cannot_leave_commit_or_report_for_its_successor():
    c = Direct(CoordinatorParams(WorkerCounts.of(2, min_workers=1)), clock=FakeClock())
    register(c, "a", incarnation="first")
    register(c, "b", incarnation="first")
    register(c, "a", incarnation="second")  # restarted in place
    assert members(c) == ["b"]
    assert commit(c, "b", 1).membership_version == 3 and members(c) == ["b", "a"]  # admitted at b's commit
    version = c.membership.version
    old = pb.CommitRequest(worker_id="a", membership_version=version, commit_id=2, incarnation="first")
    assert not c.Commit(old).recorded  # the old process does not stand in for the new one
    c.ReportFailure(pb.FailureReport(worker_id="a", membership_version=version, incarnation="first"))
    c.Leave(pb.LeaveRequest(worker_id="a", reason="exiting", incarnation="first"))
    assert c.membership.version == version and members(c) == ["b", "a"]
    assert c.heartbeat(pb.HeartbeatRequest(worker_id="a", incarnation="second")).known


def test_a_long_poll_of_a_process_replaced_while_it_waits_returns_replaced_not_its_successors_rank():
    c = Direct(CoordinatorParams(WorkerCounts.of(2)), clock=FakeClock())
    register(c, "a", incarnation="first")
    answer = {}

    def wait():
        request = pb.GetMembershipRequest(worker_id="a", incarnation="first", wait_s=20)
        answer["response"] = c.GetMembership(request)

    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 10
    while not c.state.polling.get("a"):  # until it is blocked in the long poll
        assert time.monotonic() < deadline
        time.sleep(0.01)
    register(c, "a", incarnation="second")
    register(c, "b", incarnation="first")  # the membership forms, with the new "a" in it
    waiter.join(timeout=10)
    assert answer["response"].replaced


def test_after_a_coordinator_restart_an_adopted_member_relaunched_elsewhere_replaces_it(monkeypatch):
    c = Direct(CoordinatorParams(WorkerCounts.of(2, min_workers=1)), clock=FakeClock())
    known = pb.Membership(version=4, members=[pb.Member(worker_id=w, address=f"h:{w}") for w in "ab"])
    c.Register(pb.RegisterRequest(worker_id="b", address="h:b", membership=known, incarnation="b1"))
    monkeypatch.setattr(c, "probe", lambda address: False)  # "a" (adopted, incarnation unknown) is gone
    response = register(c, "a", "h:a2", incarnation="a2")
    assert response.joins_running_job and members(c) == ["b"]
