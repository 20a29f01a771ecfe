"""Keras callbacks that write files, given to every worker: TensorBoard writes one set of event
files, CSVLogger every row once (append=True too), BackupAndRestore resumes and ends cleanly, with
a backup directory the workers share or one of each worker's own; resumed training equals one
process interrupted and resumed the same way."""

import os
import sys

import numpy as np
import pytest

from tests.launch import read_reports, run_alone, run_job, worker_script

pytestmark = pytest.mark.slow


def test_file_writing_callbacks_write_once_and_backups_resume(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one-files").mkdir()
    alone = run_alone(
        [sys.executable, worker_script("strategy_callbacks.py"), str(tmp_path / "one"), str(tmp_path / "one-files")],
        timeout=240,
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    (reference,) = read_reports(tmp_path / "one", [0])
    results, files = tmp_path / "results", tmp_path / "files"
    results.mkdir()
    files.mkdir()
    job = run_job(2, [sys.executable, worker_script("strategy_callbacks.py"), str(results), str(files)], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    workers = read_reports(results, range(2))

    # TensorBoard: one event file per fit in each of train/ and validation-free runs, as one process.
    for run in ("train",):
        ours = sorted(os.listdir(files / "logs" / run))
        assert len(ours) == len(os.listdir(tmp_path / "one-files" / "logs" / run)) == 2, ours
    # CSVLogger with append=True over two fits of 2 epochs: a header and 4 rows, as one process.
    lines = (files / "log.csv").read_text().splitlines()
    assert len(lines) == len((tmp_path / "one-files" / "log.csv").read_text().splitlines()) == 5, lines
    assert lines[0].startswith("epoch")
    for backup in ("shared", "own"):
        for worker in workers:
            assert worker[backup]["epochs_after_resume"] == reference[backup]["epochs_after_resume"] == 2
            assert worker[backup]["weights"] == workers[0][backup]["weights"]
            assert worker[backup]["iterations"] == reference[backup]["iterations"]
            assert not worker[backup]["backup_left"]
        for ours, theirs in zip(workers[0][backup]["weights"], reference[backup]["weights"], strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-9, err_msg=backup)
