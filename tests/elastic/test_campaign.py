"""A randomized failure campaign: elastic Keras jobs as users write them, hit by seeded faults.

Each trial runs ``tests/workers/elastic_campaign.py`` on 3 workers (``--min-workers 2 --max-
restarts 2 --heartbeat-timeout 3``) and injects one kind of fault, in rotation: SIGKILL before a
step or between a step and its commit, two SIGKILLs in a row, SIGTERM, and SIGSTOP past the
heartbeat timeout followed by SIGCONT; in ``model.fit`` or a custom loop, alternating from a
start the seed picks; reading in-memory arrays by index (``ElasticRecords``, even trials) or
TFRecord files of uneven sizes (``ElasticFiles``, odd trials). A run of the suite makes five
trials, one per kind; ten meet every kind in both modes and with both sources. The batch size,
commit interval, faulted ranks and steps are drawn from the trial's seed. Replacements (kills)
and the stopped worker (after SIGCONT) join again before the last epoch. After every epoch every
record's tally equals the epoch number; at the end every member holds bitwise-identical weights
and optimizer state, its learning rate is the one its reset callback sets for the final number
of workers, and each member ran the callbacks once per membership.

Seeds: ``EDL_CAMPAIGN_SEED`` (printed; by default from the clock), trial ``i`` uses seed + i.
Run 50 trials (the suite makes five, to stay within its time)::

    EDL_CAMPAIGN_TRIALS=50 python3 -m pytest tests/elastic/test_campaign.py -q -s --timeout 300
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

WORKERS, RECORDS, EPOCHS = 3, 72, 3
KINDS = ("kill_before", "kill_after", "double_kill", "term", "stop")
MODES = ("fit", "loop")
SOURCES = ("records", "files")  # in-memory arrays by index (ElasticRecords), or TFRecord files (ElasticFiles)
FILE_RECORDS = [15, 9, 0, 20, 28]  # uneven, one empty: 72 records in all
TRIALS = int(os.environ.get("EDL_CAMPAIGN_TRIALS", len(KINDS)))
SEED = int(os.environ.get("EDL_CAMPAIGN_SEED", time.time_ns() % 100000))
BASE_LR = 0.01  # as in the worker


def plan(trial: int) -> dict:
    """The trial's configuration: its fault kind and mode rotate, the rest comes from its seed."""
    rnd = random.Random(SEED + trial)
    kind = KINDS[trial % len(KINDS)]
    # Both modes in every run; with 5 kinds, trials i and i + 5 give kind i the other mode and source.
    mode = MODES[(SEED + trial) % len(MODES)]
    source = SOURCES[trial % len(SOURCES)]
    batch = rnd.choice([2, 3, 4])
    first_epoch_steps = -(-RECORDS // (WORKERS * batch))
    step = rnd.randint(1, first_epoch_steps - 1)
    rank = rnd.randrange(WORKERS)
    if kind == "double_kill":
        faults = [
            {"kind": "kill_before", "target": f"rank:{rank}", "step": step},
            # The second victim is one of the two survivors (a replacement joins later, at the back).
            {"kind": rnd.choice(["kill_before", "kill_after"]), "target": f"rank:{rnd.randrange(2)}",
             "step": step + rnd.randint(1, 4)},
        ]  # fmt: skip
    else:
        faults = [{"kind": kind, "target": f"rank:{rank}", "step": step}]
    return {
        "records": RECORDS,
        "epochs": EPOCHS,
        "batch": batch,
        "commit_every": rnd.choice([1, 2, 3, 5]),
        "mode": mode,
        "source": source,
        "faults": faults,
        "final_size": WORKERS - 1 if kind == "term" else WORKERS,
    }


def _write_files(directory) -> list:
    """The campaign's records as TFRecord files: record i holds i, its features and its label."""
    import tensorflow as tf

    from tests.workers.campaign_data import dataset_arrays, serialize

    directory.mkdir()
    features, labels = dataset_arrays(RECORDS)
    names, record = [], 0
    for index, count in enumerate(FILE_RECORDS):
        names.append(str(directory / f"part-{index}.tfrecord"))
        with tf.io.TFRecordWriter(names[-1]) as writer:
            for i in range(record, record + count):
                writer.write(serialize(i, features[i], labels[i]))
        record += count
    assert record == RECORDS
    return names


def _read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not written yet, or being written


def _continue_after_eviction(tmp_path, job, deadline):
    """For a SIGSTOP trial: waits until the others re-formed without the stopped worker, then SIGCONTs it."""
    while time.monotonic() < deadline and job.proc.poll() is None:
        for fault_file in tmp_path.glob("*.fault"):
            record = _read_json(fault_file)
            if record is None or record["kind"] != "stop":
                continue
            others = [p for p in tmp_path.glob("*.resets") if p.stem != fault_file.stem]
            versions = [int(line.split()[0]) for p in others for line in p.read_text().splitlines()]
            if versions and max(versions) > record["version"]:
                os.kill(record["pid"], signal.SIGCONT)
                return record
        time.sleep(0.1)  # polling the workers' marker files
    raise AssertionError("the stopped worker was not evicted in time")


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_failures_keep_exactly_once_and_identical_replicas(tmp_path, trial):
    config = plan(trial)
    if config["source"] == "files":
        config["files"] = _write_files(tmp_path / "data")
    print(f"EDL_CAMPAIGN_SEED={SEED} trial {trial}: {json.dumps(config)}")
    command = [sys.executable, worker_script("elastic_campaign.py"), str(tmp_path), json.dumps(config)]
    flags = ["--min-workers", "2", "--max-restarts", "2", "--heartbeat-timeout", "3", "--rendezvous-timeout", "60"]
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        job = Job(launcher_argv(WORKERS, command, flags), output=log)
        try:
            deadline = time.monotonic() + 240
            if config["faults"][0]["kind"] == "stop":
                _continue_after_eviction(tmp_path, job, deadline)
            code = job.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            job.kill()
    output = log_path.read_text()
    context = f"seed {SEED} trial {trial} {json.dumps(config)}\n{output[-4000:]}"
    assert code == 0, context
    reports = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("worker-*.json")}
    final_size = config["final_size"]
    assert len(reports) == final_size and all(r["size"] == final_size for r in reports.values()), (
        sorted(reports),
        context,
    )
    first = next(iter(reports.values()))
    for worker_id, report in reports.items():
        assert report["weights"] == first["weights"], (worker_id, "weights differ", context)
        assert report["optimizer"] == first["optimizer"], (worker_id, "optimizer state differs", context)
        assert report["learning_rate"] == BASE_LR * final_size, (worker_id, report["learning_rate"], context)
        checks = report["epoch_checks"]
        assert checks and all(checks.values()), (worker_id, checks, context)
        assert EPOCHS in {int(e) for e in checks}, (worker_id, checks, context)
        versions = [version for version, _ in report["resets"]]
        assert versions == sorted(set(versions)), (worker_id, "callbacks ran twice in a membership", context)
        assert versions[-1] == report["version"], (worker_id, report["resets"], context)
        trained_in = {int(line.split()[0]) for line in (tmp_path / f"{worker_id}.steps").read_text().splitlines()}
        assert trained_in <= set(versions), (worker_id, "trained without its callbacks", trained_in, context)
    counts = np.array(first["counts"])
    assert counts.shape == (RECORDS,) and np.all(counts == EPOCHS), (counts.min(), counts.max(), context)
    if config["faults"][0]["kind"] == "term":
        _check_graceful_leave(tmp_path, output, context)


def _check_graceful_leave(tmp_path, output, context):
    (fault_file,) = tmp_path.glob("*.fault")
    fault = json.loads(fault_file.read_text())
    leaver = fault_file.stem
    assert "rolling back" not in output, context
    assert "left the job gracefully" in output, context
    exit_time = float((tmp_path / f"{leaver}.exit").read_text())
    first_steps = [
        float(line.split()[2])
        for p in tmp_path.glob("*.steps")
        if p.stem != leaver
        for line in p.read_text().splitlines()
        if int(line.split()[0]) > fault["version"]
    ]
    to_exit, to_next_step = exit_time - fault["time"], min(first_steps) - fault["time"]
    print(f"SIGTERM to the leaver's exit {to_exit:.2f}s, to the first step without it {to_next_step:.2f}s")
    # Far below Kubernetes' default grace period of 60 s, with room for a loaded machine.
    assert to_exit < 20 and to_next_step < 20, (to_exit, to_next_step, context)
