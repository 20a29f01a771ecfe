"""A fixed global batch: a job that loses a worker and gains a replacement at random steps ends with
the model of one process on the global batch (float64, 1e-9), in fit and in a custom loop."""

import json
import os
import random
import sys
import time

import numpy as np
import pytest

from tests.launch import run_alone, run_job, worker_script

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("EDL_TEST_SEED", time.time_ns() % 100000))


# fit averages each worker's loss first: exact when the global batch divides by 2 and by 3 workers.
# The loop averages over the global batch itself: exact with shares of 4, 3 and 3.
@pytest.mark.parametrize("mode, global_batch", [("fit", 12), ("loop", 10)])
def test_kill_and_join_at_random_steps_train_the_model_of_one_process(tmp_path, mode, global_batch):
    rnd = random.Random(SEED)
    kill = rnd.randint(2, 5)  # of 12 (fit) or 16 (loop: 7 steps of 10 and one of 2 per epoch) steps
    config = {"records": 72, "global_batch": global_batch, "epochs": 2, "mode": mode, "workers": 3}
    faulted = {**config, "kill": kill, "hold": kill + rnd.randint(1, 4)}
    print(f"EDL_TEST_SEED={SEED}: {json.dumps(faulted)}")
    (tmp_path / "alone").mkdir()
    command = [sys.executable, worker_script("elastic_global_batch.py")]
    alone = run_alone([*command, str(tmp_path / "alone"), json.dumps(config)])
    assert alone.returncode == 0, alone.stderr[-3000:]
    reference = json.loads((tmp_path / "alone" / "alone.json").read_text())
    flags = ["--min-workers", "2", "--max-restarts", "1", "--heartbeat-timeout", "3"]
    job = run_job(3, [*command, str(tmp_path), json.dumps(faulted)], flags, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert (tmp_path / "killed").exists()
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("worker-*.json")]
    assert len(reports) == 3
    assert set().union(*(r["sizes"] for r in reports)) == {2, 3}  # trained with 3, then 2, then 3 again
    for report in reports:
        assert report["steps"] == reference["steps"] == 2 * -(-72 // global_batch)
        for mine, single in zip(report["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(mine, single, rtol=0, atol=1e-9)
