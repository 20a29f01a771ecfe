"""Hierarchical all-reduce between real hosts: two network namespaces, two worker processes in each
(each namespace's own shared-memory directory, so shared memory within a host and data sockets
between hosts). Needs root and ``ip netns`` (skipped otherwise)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from elasticdl_strategy.transport.auth import new_token
from tests import netns
from tests.launch import worker_script

pytestmark = pytest.mark.slow

SIZE = 1 << 22  # bytes of the workers' array


def _wait_for(predicate, timeout, what, procs):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"a process ended while waiting for {what}"
        time.sleep(0.05)  # polling for files written by the worker processes


@pytest.fixture
def job(tmp_path):
    """Starts a coordinator on host a and workers w0, w1 on a and w2, w3 on b; yields
    ``(workers: {worker_id: Popen}, started: {worker_id: report})``; kills every process after."""
    with netns.two_hosts_or_skip() as hosts:
        token = new_token()
        env = dict(os.environ, EDL_JOB_TOKEN=token, PYTHONPATH=os.getcwd(), EDL_TIMEOUT="20")
        port_file = tmp_path / "port"
        procs = []
        try:
            coordinator = [
                sys.executable, "-m", "elasticdl_strategy", "coordinator", "--bind", hosts.address_a,
                "--port-file", str(port_file), "--workers", "4", "--heartbeat-timeout", "4",
                "--heartbeat-interval", "0.5",
            ]  # fmt: skip
            procs.append(subprocess.Popen(["ip", "netns", "exec", hosts.namespace_a, *coordinator], env=env))
            _wait_for(port_file.exists, 30, "the coordinator", procs)
            address = f"{hosts.address_a}:{port_file.read_text()}"
            workers = {}
            a, b = (hosts.namespace_a, hosts.address_a), (hosts.namespace_b, hosts.address_b)
            for worker_id, (ns, host) in zip(("w0", "w1", "w2", "w3"), (a, a, b, b)):
                shm = tmp_path / f"shm-{ns}"
                shm.mkdir(exist_ok=True)
                worker_env = dict(
                    env, EDL_COORDINATOR_ADDR=address, EDL_WORKER_ID=worker_id, EDL_BIND_HOST=host, EDL_SHM_DIR=str(shm)
                )
                script = worker_script("hierarchical_hosts.py")
                command = ["ip", "netns", "exec", ns, sys.executable, script, str(tmp_path)]
                workers[worker_id] = subprocess.Popen(command, env=worker_env)
                procs.append(workers[worker_id])
            files = {w: tmp_path / f"{w}-started.json" for w in workers}
            _wait_for(lambda: all(f.exists() for f in files.values()), 90, "every worker's first all-reduces", procs)
            yield workers, {w: json.loads(f.read_text()) for w, f in files.items()}, tmp_path
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)


def test_two_hosts_of_two_workers_reduce_within_hosts_and_cross_once_per_host(job):
    workers, started, _ = job
    host = {"w0": "a", "w1": "a", "w2": "b", "w3": "b"}
    by_rank = {r["rank"]: w for w, r in started.items()}
    assert all(r["exact"] for r in started.values()), started
    for worker_id, report in started.items():
        mates = [r["rank"] for w, r in started.items() if host[w] == host[worker_id] and w != worker_id]
        assert report["shared_memory_peers"] in ([], mates), started  # only its host's workers, if any
        leader = min([report["rank"], *mates]) == report["rank"]
        # A member sends its array to its leader; a leader its ring share to the other leader and
        # the result to its member: (1 + 1/2) arrays, where the flat ring sends 3/2 from everyone.
        assert report["sent"] == (SIZE + SIZE if leader else SIZE), (worker_id, started, by_rank)


def test_a_killed_leader_fails_the_all_reduce_on_every_other_worker(job):
    workers, started, results = job
    host_b = ("w2", "w3")
    leader = min(host_b, key=lambda w: started[w]["rank"])
    workers[leader].send_signal(signal.SIGKILL)
    killed_at = time.time()
    for worker_id, proc in workers.items():
        if worker_id != leader:
            proc.wait(timeout=30)  # each one's collective fails, and it exits
    for worker_id in workers:
        if worker_id == leader:
            continue
        report = json.loads((results / f"{worker_id}.json").read_text())
        assert report["error"] in ("PeerFailureError", "CollectiveTimeoutError"), report
        assert report["at"] - killed_at < 10.0, report
