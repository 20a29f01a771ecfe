"""A worker joining a running job returns from ``runtime.init(admit_in_background=True)`` once
registered, and is admitted at the members' next commit in the background."""

import os
import threading

import numpy as np
import pytest

from elasticdl_strategy import runtime
from elasticdl_strategy.coordinator.params import CoordinatorParams
from elasticdl_strategy.coordinator.server import CoordinatorServer
from elasticdl_strategy.coordinator.worker_counts import WorkerCounts
from elasticdl_strategy.environment import COORDINATOR_ADDR, JOB_TOKEN, WORKER_ID, WorkerEnvironment
from elasticdl_strategy.errors import UsageError, WorkerLeft
from elasticdl_strategy.runtime.worker import Worker
from elasticdl_strategy.transport.auth import new_token
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import coordinator_pb2
from tests.conditions import wait_for


@pytest.fixture
def running_job():
    """A coordinator (1 worker wanted, up to 2) and its one member, training."""
    token = new_token()
    params = CoordinatorParams(WorkerCounts.of(1, max_workers=2), heartbeat_interval_s=0.2, heartbeat_timeout_s=5)
    server = CoordinatorServer(params, "127.0.0.1:0", token, TransportOptions())
    env = {COORDINATOR_ADDR: f"127.0.0.1:{server.port}", JOB_TOKEN: token}
    member = Worker.join(WorkerEnvironment.from_env({**env, WORKER_ID: "member"}))
    try:
        yield server, env, member
    finally:
        runtime.shutdown(finished=False)
        member.shutdown()
        server.stop(0)


def _members(server):
    return [m.worker_id for m in server.coordinator.membership.members]


def _init_in_thread(env):
    """runtime.init in a thread of its own (a test must not hang on it): (thread, error box)."""
    errors = []

    def init():
        try:
            runtime.init({**env, WORKER_ID: "joiner"}, admit_in_background=True)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    thread = threading.Thread(target=init, daemon=True)
    thread.start()
    return thread, errors


def test_a_joiner_returns_once_registered_and_waits_for_its_admission_where_it_needs_the_membership(running_job):
    server, env, member = running_job
    thread, errors = _init_in_thread(env)
    thread.join(10)
    assert not thread.is_alive() and not errors, errors
    assert runtime.joined_running_job() and runtime.is_initialized()
    assert _members(server) == ["member"]  # not admitted yet: the member has not committed

    sizes = []
    waiting = threading.Thread(target=lambda: sizes.append(runtime.size()), daemon=True)
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive()  # size() waits for the admission

    response = member.client.commit(1, 1, coordinator_pb2.DataPosition(), [], timeout=5)
    assert response.membership_version == 2 and _members(server) == ["member", "joiner"]
    member.reform("joins at commit #1", failed=False, timeout=10)
    waiting.join(10)
    assert sizes == [2] and runtime.rank() == 1
    total = [None]
    summing = threading.Thread(target=lambda: total.__setitem__(0, member.communicator.allreduce(np.ones(3))))
    summing.start()
    np.testing.assert_array_equal(runtime.allreduce(np.full(3, 2.0), timeout=10), [3.0, 3.0, 3.0])
    summing.join(10)
    np.testing.assert_array_equal(total[0], [3.0, 3.0, 3.0])


def test_a_joiner_shut_down_before_its_admission_stops_waiting_and_is_not_admitted(running_job):
    server, env, member = running_job
    thread, errors = _init_in_thread(env)
    thread.join(10)
    assert not thread.is_alive() and not errors, errors
    admission = runtime._admission
    runtime.shutdown(finished=False)
    assert not admission.thread.is_alive()  # shutdown waited for it to give up
    assert isinstance(admission.error, WorkerLeft)
    with pytest.raises(UsageError, match="not initialized"):
        runtime.size()
    wait_for(lambda: [w.worker_id for w in server.coordinator.state.live()] == ["member"], "the joiner to leave", 10)
    response = member.client.commit(1, 1, coordinator_pb2.DataPosition(), [], timeout=5)
    assert response.membership_version == 1 and _members(server) == ["member"]


def test_where_the_hosts_workers_outnumber_its_cores_a_joiner_returns_only_once_admitted(running_job):
    # Building there would take the cores the members train on, while they wait for it anyway.
    server, env, member = running_job
    crowded = {**env, "EDL_LOCAL_SIZE": str(len(os.sched_getaffinity(0)) + 1)}
    thread, errors = _init_in_thread(crowded)
    wait_for(lambda: "joiner" in [w.worker_id for w in server.coordinator.state.live()], "the joiner to register")
    thread.join(0.5)
    assert thread.is_alive()  # registered, not admitted: init waits
    member.client.commit(1, 1, coordinator_pb2.DataPosition(), [], timeout=5)
    thread.join(10)
    assert not thread.is_alive() and not errors, errors
    assert runtime.current_worker().membership.version == 2 and runtime.joined_running_job()
