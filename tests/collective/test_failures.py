"""Failures between processes: a SIGKILLed peer, ranks that disagree."""

import json
import sys

import numpy as np
import pytest

from elasticdl_strategy.errors import PeerFailureError
from elasticdl_strategy.transport import life_marks
from tests.cluster import ThreadCluster
from tests.launch import TRANSPORTS, read_reports, run_job, transport_env, worker_script
from tests.memory_holder import cross_memory_allowed

pytestmark = pytest.mark.slow


def _survivors(results_dir, n, victim):
    return read_reports(results_dir, [r for r in range(n) if r != victim["rank"]])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 4])
def test_sigkill_of_a_peer_raises_peer_failure_on_survivors_within_2s(tmp_path, n, transport):
    env = transport_env(transport)
    job = run_job(n, [sys.executable, worker_script("peer_killed.py"), str(tmp_path)], timeout=90, env=env)
    victim = json.loads((tmp_path / "victim.json").read_text())
    assert job.returncode != 0  # the launcher reports the killed worker
    assert "was killed by signal 9" in job.stderr
    for outcome in _survivors(tmp_path, n, victim):
        assert outcome["error"] == "PeerFailureError", outcome
        assert outcome["peer_rank"] == victim["rank"], outcome
        assert f"rank {victim['rank']}" in outcome["message"]
        assert outcome["at"] - victim["killed_at"] < 2.0, outcome
        # The streams this rank sent on (to every peer, or to its recursive-doubling partners) took
        # the transport's path.
        others = {r for r in range(n) if r != outcome["rank"]}
        streams = set(outcome["data_socket_peers"] if transport != "grpc" else outcome["shared_memory_peers"])
        assert transport == "grpc" or streams and streams <= others, outcome
        shared = transport in ("host-segment", "shared-memory")
        assert outcome["shared_memory_peers"] == (sorted(streams) if shared else []), outcome
        assert outcome["data_socket_peers"] == (sorted(streams) if transport != "grpc" else []), outcome


@pytest.mark.parametrize("n, how", [(2, "kill-in-place"), (4, "kill-in-place"), (4, "kill-pieces")])
def test_sigkill_of_a_peer_during_allreduces_read_where_they_lie_raises_peer_failure_within_2s(tmp_path, n, how):
    if not cross_memory_allowed():
        pytest.skip("this machine does not let a process read another's memory")
    env = transport_env("host-segment")
    command = [sys.executable, worker_script("peer_killed.py"), str(tmp_path), how]
    job = run_job(n, command, timeout=90, env=env)
    victim = json.loads((tmp_path / "victim.json").read_text())
    assert "was killed by signal 9" in job.stderr
    for outcome in _survivors(tmp_path, n, victim):
        assert outcome["single_copy"] and outcome["beyond_a_slot"], outcome  # read where they lie
        assert outcome["reads_pieces"] or how != "kill-pieces", outcome
        assert outcome["error"] == "PeerFailureError", outcome
        assert outcome["peer_rank"] == victim["rank"], outcome
        assert outcome["at"] - victim["killed_at"] < 2.0, outcome


@pytest.mark.skipif(not life_marks.AVAILABLE, reason="life marks need Linux, glibc and x86-64")
@pytest.mark.parametrize("frames", ["data-socket", "grpc"])  # where the arena's frames travel
def test_a_killed_same_host_peer_is_seen_dead_by_its_life_mark_before_its_connections_close(tmp_path, frames):
    env = {**transport_env("shared-memory"), "EDL_DATA_SOCKET": "1" if frames == "data-socket" else "0"}
    command = [sys.executable, worker_script("peer_killed.py"), str(tmp_path), "kill-large"]
    job = run_job(2, command, timeout=90, env=env)
    victim = json.loads((tmp_path / "victim.json").read_text())
    assert "was killed by signal 9" in job.stderr
    for outcome in _survivors(tmp_path, 2, victim):
        assert outcome["error"] == "PeerFailureError", outcome
        assert "its process ended" in outcome["message"], outcome  # not "the connection broke"


def test_hung_peer_is_declared_dead_by_the_coordinator_and_survivors_raise(tmp_path):
    n, heartbeat_timeout = 3, 2.0
    job = run_job(
        n,
        [sys.executable, worker_script("peer_killed.py"), str(tmp_path), "stop"],
        extra=["--heartbeat-timeout", str(heartbeat_timeout)],
        timeout=90,
    )
    victim = json.loads((tmp_path / "victim.json").read_text())
    assert job.returncode != 0
    for outcome in _survivors(tmp_path, n, victim):
        assert outcome["error"] == "PeerFailureError", outcome
        assert outcome["peer_rank"] == victim["rank"], outcome
        assert "removed it in membership version 2" in outcome["message"], outcome
        # heartbeat timeout + the coordinator's reaping period + one heartbeat interval + the
        # survivors' own health probe of it (1 s; a job that is not elastic asks for that proof)
        assert outcome["at"] - victim["killed_at"] < heartbeat_timeout + 3.0, outcome


def test_shape_mismatch_between_processes_raises_on_every_rank(tmp_path):
    n = 3
    job = run_job(n, [sys.executable, worker_script("mismatch.py"), str(tmp_path)], timeout=90)
    assert job.returncode == 0, job.stderr[-2000:]
    for rank in range(n):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["error"] == "CollectiveMismatchError", outcome
        assert "shape" in outcome["message"]
        assert n - 1 in outcome["ranks"] or f"rank {n - 1}" in outcome["message"]


def test_a_collective_that_needs_a_peer_that_left_aborts_the_communicator():
    # A peer closing its communicator on purpose aborts nothing by itself (it may have finished);
    # a collective that needs it fails and leaves the communicator aborted, as after any failure,
    # so that the elastic layer can tell a failure from an error in the program.
    with ThreadCluster(2) as cluster:
        survivor, leaver = cluster.communicators
        cluster.run(lambda c: c.allreduce(np.ones(4, np.float32)))  # opens the streams both ways
        leaver.close(timeout=2.0)
        assert survivor.failure is None
        with pytest.raises(PeerFailureError) as raised:
            survivor.allreduce(np.ones(4, np.float32), timeout=10)
        assert raised.value.peer_rank == 1
        assert isinstance(survivor.failure, PeerFailureError) and "rank 1" in str(survivor.failure)
        with pytest.raises(PeerFailureError):
            survivor.barrier(timeout=10)
