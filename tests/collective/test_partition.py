"""Two hosts (network namespaces joined by a veth pair) and a cut between them.

A cut link sends no FIN or RST: nothing tells the sockets. The survivor's collective must still
fail with a typed error within seconds (gRPC keepalive, the coordinator's heartbeats), on the data
socket as on gRPC, and its process must still exit: no thread may stay blocked on a dead connection.
Needs root and ``ip netns`` (skipped otherwise).
"""

import json
import os
import subprocess
import sys
import time

import pytest

from elasticdl_strategy.transport.auth import new_token
from tests import netns
from tests.launch import transport_env, worker_script

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 4.0


@pytest.fixture
def two_hosts():
    """``(namespace_a, address_a, namespace_b, address_b, cut)``; ``cut()`` takes b's end of the link down."""
    with netns.two_hosts_or_skip() as hosts:
        yield hosts


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling for files written by the worker processes


@pytest.mark.parametrize("transport", ["data-socket", "grpc"])
def test_a_cut_between_hosts_fails_the_survivors_collective_and_it_still_exits(tmp_path, two_hosts, transport):
    ns_a, host_a, ns_b, host_b, cut = two_hosts
    token = new_token()
    env = dict(os.environ, EDL_JOB_TOKEN=token, PYTHONPATH=os.getcwd(), **transport_env(transport))
    env["EDL_SHARED_MEMORY"] = "0"  # /dev/shm is shared between namespaces; these are two hosts
    port_file = tmp_path / "port"
    procs = []
    try:
        coordinator = [
            sys.executable, "-m", "elasticdl_strategy", "coordinator", "--bind", host_a, "--port-file", str(port_file),
            "--workers", "2", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--heartbeat-interval", "0.5",
        ]  # fmt: skip
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns_a, *coordinator], env=env))
        _wait_for(port_file.exists, 30, "the coordinator")
        address = f"{host_a}:{port_file.read_text()}"
        for worker_id, ns, host in (("w0", ns_a, host_a), ("w1", ns_b, host_b)):
            worker_env = dict(env, EDL_COORDINATOR_ADDR=address, EDL_WORKER_ID=worker_id, EDL_BIND_HOST=host)
            command = ["ip", "netns", "exec", ns, sys.executable, worker_script("partitioned.py"), str(tmp_path)]
            procs.append(subprocess.Popen(command, env=worker_env))
        _wait_for(lambda: all((tmp_path / f"w{i}.started").exists() for i in range(2)), 60, "both workers")
        cut()  # w1 (host b) is cut off from w0 and the coordinator (host a)
        cut_at = time.time()
        survivor = procs[1]  # w0
        survivor.wait(timeout=HEARTBEAT_TIMEOUT_S + 20)  # it exits: nothing hangs on the dead connections
        report = json.loads((tmp_path / "w0.json").read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    other = 1 - report["rank"]
    assert report["data_socket_peers"] == ([other] if transport == "data-socket" else [])
    assert report["error"] in ("PeerFailureError", "CollectiveTimeoutError"), report
    assert f"rank {other}" in report["message"], report
    # gRPC keepalive (2 s + 2 s) or the coordinator's heartbeat timeout, whichever comes first, plus slack
    print(f"{transport}: the survivor's collective failed {report['at'] - cut_at:.2f}s after the cut")
    assert report["at"] - cut_at < HEARTBEAT_TIMEOUT_S + 4.0, report
