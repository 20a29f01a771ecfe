"""TensorFlow's checkpoint writers called from every worker (as TensorFlow's guides call them) write
one consistent checkpoint, return the same path and counter everywhere, and restore identically;
a save that rank 0 alone makes inside strategy.scope() does not stall or desynchronize the job."""

import os
import sys

import pytest

from tests.launch import read_reports, run_job, worker_script

pytestmark = pytest.mark.slow


def test_checkpoint_writers_called_from_every_worker(tmp_path):
    results, directory = tmp_path / "results", tmp_path / "ckpt"
    results.mkdir()
    job = run_job(2, [sys.executable, worker_script("strategy_checkpoints.py"), str(results), str(directory)])
    assert job.returncode == 0, job.stderr[-3000:]
    ranks = read_reports(results, range(2))
    same = ["saved", "save_counter", "written", "managed", "manager_checkpoints", "manager_latest", "tf_latest"]
    for key in same + ["at_save", "trained", "restored", "restored_iterations", "exported_output"]:
        assert ranks[0][key] == ranks[1][key], key
    report = ranks[0]
    assert report["saved"] == [str(directory / "plain" / f"ckpt-{i}") for i in range(1, 5)]
    assert report["save_counter"] == 4
    assert report["managed"] == [str(directory / "managed" / f"ckpt-{i}") for i in range(5, 9)]
    assert report["manager_checkpoints"] == report["managed"][-2:]
    assert report["manager_latest"] == report["managed"][-1]
    assert report["tf_latest"] == report["manager_latest"]
    # max_to_keep=2 holds on disk: rank 0 swept; nobody else wrote or deleted anything.
    managed = sorted(os.listdir(directory / "managed"))
    assert managed == sorted(
        ["checkpoint"] + [f"ckpt-{i}.{s}" for i in (7, 8) for s in ("index", "data-00000-of-00001")]
    )
    assert not any("temp" in name for _, dirs, files in os.walk(directory) for name in dirs + files)
    assert report["restored"] == report["at_save"] and report["restored_iterations"] == report["iterations_at_save"]
    assert (directory / "saved_model" / "saved_model.pb").exists()
    assert ranks[0]["guarded"] == str(directory / "guarded" / "ckpt-1") and "guarded" not in ranks[1]
