"""Elastic jobs through the real launcher: failures, joins, leaves, restarts, exactly-once.

The workers train tests/workers/elastic_counter.py, whose ``counts[i]`` is
the number of times record ``i`` was trained on: after every epoch all counts
must equal the epoch number, whatever failed on the way.
"""

import json
import os
import random
import signal
import sys
import time

import numpy as np
import pytest

from tests.launch import Job, launcher_argv, worker_script

pytestmark = pytest.mark.slow

RECORDS, BATCH, EPOCHS = 240, 4, 3
BASE = {"records": RECORDS, "batch": BATCH, "epochs": EPOCHS, "commit_every": 2}
# Steps in the whole job are between 60 (4 workers) and 120 (2 workers): kill well inside it.
SEED = int(os.environ.get("EDL_TEST_SEED", time.time_ns() % 100000))
# By worker id, not rank: if one victim dies first and the group re-forms, the other may be renumbered out of
# its "rank:R" and live on.
TWO_DIE_AT_5 = {"kill": {"worker-1": 5, "worker-2": 5}}


def random_step(low=6, high=40):
    step = random.Random(SEED).randint(low, high)
    print(f"EDL_TEST_SEED={SEED}: step {step}")
    return step


def launch(tmp_path, workers, config, extra=()):
    command = [sys.executable, worker_script("elastic_counter.py"), str(tmp_path), json.dumps({**BASE, **config})]
    flags = ["--heartbeat-timeout", "3", "--rendezvous-timeout", "30", *extra]
    return Job(launcher_argv(workers, command, flags))


def finish(job, timeout=150):
    try:
        out, err = job.proc.communicate(timeout=timeout)
    finally:
        job.kill()
    return job.proc.returncode, out, err


def reports(tmp_path):
    return {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("worker-*.json")}


def dead(tmp_path):
    return sorted(p.stem for p in tmp_path.glob("worker-*.dead"))


def assert_exactly_once_and_identical(found, expected_count):
    assert len(found) == expected_count, sorted(found)
    first = next(iter(found.values()))
    for worker_id, report in found.items():
        counts = np.array(report["counts"])
        assert np.all(counts == EPOCHS), (worker_id, counts.min(), counts.max())
        # Checked at the end of every epoch this process trained through (a joiner: the later ones).
        checks = report["epoch_checks"]
        epochs = sorted(int(e) for e in checks)
        assert epochs == list(range(epochs[0], EPOCHS + 1)), (worker_id, checks)
        assert all(check["ok"] for check in checks.values()), (worker_id, checks)
        # Bitwise identical state everywhere (seen[0] counts every record trained on).
        assert report["counts"] == first["counts"] and report["seen"] == first["seen"], worker_id
        assert report["commit_id"] == first["commit_id"]
    assert first["seen"][0] == RECORDS * EPOCHS


def test_sigkill_one_of_three_at_a_random_step(tmp_path):
    job = launch(tmp_path, 3, {"kill": {"rank:1": random_step()}}, ["--min-workers", "2"])
    code, out, err = finish(job)
    assert code == 0, err[-3000:]
    (victim,) = dead(tmp_path)
    assert f"worker {victim.split('-')[1]} was killed by signal 9; the other workers carry on" in err
    assert "rolling back to the last commit" in out + err
    # Its ring neighbour watched its life mark: the coordinator took the report of its death unprobed.
    assert f"worker {victim} (" in err and "saw: declared dead" in err, err[-3000:]
    found = reports(tmp_path)
    assert_exactly_once_and_identical(found, 2)
    assert victim not in found and all(r["size"] == 2 for r in found.values())
    # Reset callbacks ran once per membership: on entry with 3 workers, after the failure with 2.
    assert all(r["resets"] == [3, 2] for r in found.values())


def test_worker_killed_while_the_state_is_synced(tmp_path):
    # worker-1 dies; worker-2 dies at the start of the sync that follows (its second sync).
    config = {"kill": {"rank:3": random_step()}, "kill_in_sync": {"rank:1": 2}}
    code, out, err = finish(launch(tmp_path, 4, config, ["--min-workers", "2"]))
    assert code == 0, err[-3000:]
    assert "killing myself at the start of sync #2" in out
    assert len(dead(tmp_path)) == 2
    assert_exactly_once_and_identical(reports(tmp_path), 2)


def test_replacement_joins_mid_training_and_gets_the_state(tmp_path):
    step = random_step(6, 20)
    config = {"kill": {"rank:2": step}, "hold": {"at_step": step + 4, "size": 3}}
    job = launch(tmp_path, 3, config, ["--min-workers", "2", "--max-restarts", "1"])
    code, out, err = finish(job)
    assert code == 0, err[-3000:]
    assert "started worker 3 in its place (restart 1 of 1)" in err
    found = reports(tmp_path)
    assert_exactly_once_and_identical(found, 3)
    assert "worker-3" in found and all(r["size"] == 3 for r in found.values())
    assert "workers joined at commit" in err


def test_standby_takes_the_place_of_a_failed_worker(tmp_path):
    job = launch(tmp_path, 3, {"kill": {"rank:1": random_step()}}, ["--max-workers", "2", "--min-workers", "1"])
    code, out, err = finish(job)
    assert code == 0, err[-3000:]
    found = reports(tmp_path)
    # The standby joined when the member died: two workers to the end, three different ones in all.
    assert_exactly_once_and_identical(found, 2)
    assert all(r["size"] == 2 for r in found.values())
    assert len(dead(tmp_path)) == 1 and dead(tmp_path)[0] not in found


def test_below_min_workers_training_waits_then_fails_clearly(tmp_path):
    # Two of three die at once: the survivor is below --min-workers=2 and waits, then gives up.
    config = TWO_DIE_AT_5
    job = launch(tmp_path, 3, config, ["--min-workers", "2", "--rendezvous-timeout", "4"])
    code, out, err = finish(job)
    assert code != 0
    assert "RendezvousTimeoutError" in err and "at least 2 needed" in err


def _live_worker_pids(tmp_path):
    """Pids of this test's worker processes still running (from /proc: survivors write no pid file)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        # The worker itself (python elastic_counter.py DIR ...), not the launcher whose command line holds it.
        if len(argv) > 2 and argv[1].endswith(b"elastic_counter.py") and argv[2] == str(tmp_path).encode():
            pids.append(int(entry))
    return pids


def test_sigterm_while_waiting_for_min_workers_leaves_at_once(tmp_path):
    # Two of three die; the survivor waits for --min-workers=2 (for up to 60 s). A SIGTERM then
    # makes it leave within a second or two, not at a commit that cannot come.
    job = launch(tmp_path, 3, TWO_DIE_AT_5, ["--min-workers", "2", "--rendezvous-timeout", "60"])
    try:
        deadline = time.monotonic() + 60
        while len(dead(tmp_path)) < 2 or len(_live_worker_pids(tmp_path)) != 1:
            assert time.monotonic() < deadline and job.proc.poll() is None, "the two victims did not die"
            time.sleep(0.1)  # polling for the victims' marker files and their processes to go
        (survivor,) = _live_worker_pids(tmp_path)
        os.kill(survivor, signal.SIGTERM)
        started = time.monotonic()
        code, out, err = finish(job, timeout=30)
    finally:
        job.kill()
    assert time.monotonic() - started < 10.0, "the survivor did not leave promptly"
    assert "asked to leave while waiting for a new membership" in out + err, err[-3000:]
    assert "RendezvousTimeoutError" not in err


def test_sigstopped_worker_is_evicted_and_the_job_continues(tmp_path):
    job = launch(tmp_path, 3, {"stop": {"rank:1": random_step()}}, ["--min-workers", "2"])
    try:
        deadline = time.monotonic() + 120
        while len(reports(tmp_path)) < 2 and job.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # polling for the survivors' report files
        found = reports(tmp_path)
        assert_exactly_once_and_identical(found, 2)
        # Woken up after the job finished, the evicted worker learns it and exits.
        (stopped,) = dead(tmp_path)
        os.kill(int((tmp_path / f"{stopped}.pid").read_text()), signal.SIGCONT)
        code, out, err = finish(job, timeout=60)
    finally:
        job.kill()
    assert "missed heartbeats" in err
    assert code == 0, err[-3000:]
    assert "the job finished without this worker; exiting" in out + err


def write_id_files(directory, records):
    """TFRecord files of uneven sizes whose records are their ids 0 .. records-1, as text."""
    import tensorflow as tf

    directory.mkdir()
    bounds = [0, records // 7, records // 7, records // 2, records * 3 // 5, records]  # one file empty
    names = []
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        names.append(str(directory / f"part-{index}.tfrecord"))
        with tf.io.TFRecordWriter(names[-1]) as writer:
            for record in range(start, end):
                writer.write(str(record).encode())
    return names


@pytest.mark.parametrize("source", ["records", "files"])
def test_all_workers_killed_then_the_job_resumes_from_the_checkpoint(tmp_path, source):
    checkpoints = tmp_path / "ckpt"
    config = {"checkpoint_dir": str(checkpoints), "checkpoint_every": 3}
    if source == "files":
        config["files"] = write_id_files(tmp_path / "data", RECORDS)
    code, out, err = finish(launch(tmp_path, 2, {**config, "kill_all_at": random_step(20, 50)}))
    assert code != 0 and not reports(tmp_path)
    assert (checkpoints / "latest").exists()
    code, out, err = finish(launch(tmp_path, 2, config))
    assert code == 0, err[-3000:]
    assert "resumed from checkpoint of commit" in out + err
    found = reports(tmp_path)
    assert_exactly_once_and_identical(found, 2)
    assert all(r["commit_id"] > 3 for r in found.values())


def test_coordinator_killed_and_restarted(tmp_path):
    # Reading TFRecord files: the restarted coordinator must accept their fingerprint again.
    config = {"records": 960, "files": write_id_files(tmp_path / "data", 960)}
    job = launch(tmp_path, 2, config, ["--min-workers", "1"])
    try:
        progress = tmp_path / "progress"
        deadline = time.monotonic() + 90
        while not (progress.exists() and int(progress.read_text() or 0) >= 20) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling rank 0's step counter
        coordinator = [p for p in job.pids() if b"coordinator" in open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")]
        assert len(coordinator) == 1
        os.kill(coordinator[0], signal.SIGKILL)
        code, out, err = finish(job)
    finally:
        job.kill()
    assert code == 0, err[-3000:]
    assert "starting it again on port" in err
    assert "coordinator restart" in err
    found = reports(tmp_path)
    assert sorted(found) == ["worker-0", "worker-1"]
    for report in found.values():
        assert np.all(np.array(report["counts"]) == EPOCHS)
        assert report["seen"][0] == 960 * EPOCHS


def test_keras_fit_resumes_at_the_right_epoch_and_batch(tmp_path):
    job = launch(tmp_path, 3, {"keras": True, "kill": {"rank:1": random_step()}}, ["--min-workers", "2"])
    code, out, err = finish(job)
    assert code == 0, err[-3000:]
    assert_exactly_once_and_identical(reports(tmp_path), 2)
