"""AllReduceStrategy on 2 worker processes trains exactly like one process on the global batch.

float64, so that the only difference (the order of a few additions) stays at
round-off level; the workers seed their initializers differently, so equal
results also show that variables start from rank 0's values.
"""

import sys

import numpy as np
import pytest

from tests.launch import read_reports, run_alone, run_job, worker_script

pytestmark = pytest.mark.slow


def _single_process(mode, out_dir):
    result = run_alone([sys.executable, worker_script("strategy_train.py"), mode, str(out_dir)])
    assert result.returncode == 0, result.stderr[-3000:]
    return read_reports(out_dir, [0])[0]


def _two_workers(mode, out_dir):
    job = run_job(2, [sys.executable, worker_script("strategy_train.py"), mode, str(out_dir)], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    return read_reports(out_dir, range(2))


@pytest.mark.parametrize("mode", ["fit", "custom"])
def test_two_workers_match_one_process_on_the_global_batch(tmp_path, mode):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    reference = _single_process(mode, tmp_path / "one")
    workers = _two_workers(mode, tmp_path / "two")

    assert reference["replicas"] == 1
    assert [w["replicas"] for w in workers] == [2, 2]
    assert sorted(w["replica_id"] for w in workers) == [0, 1]
    assert [w["replica_id"] for w in workers] == [w["rank"] for w in workers]
    for a, b in zip(workers[0]["weights"], workers[1]["weights"], strict=True):
        assert a == b  # bitwise identical on every worker
    for ours, theirs in zip(workers[0]["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
    # custom: strategy.reduce(SUM) of the per-replica losses is the global loss.
    # fit: the epoch losses in History and what evaluate() returns are global, not this worker's share.
    np.testing.assert_allclose(workers[0]["losses"], reference["losses"], rtol=1e-12)
    np.testing.assert_allclose(workers[1]["losses"], reference["losses"], rtol=1e-12)
    if mode == "custom":
        # One fused ring all-reduce for all 4 gradients (one dtype) + one for the loss:
        # 2 all-reduces x 2(N-1) messages each, whatever the number of variables.
        assert workers[0]["messages_per_step"] == 2 * 2 * (2 - 1)


def test_jit_compile_fails_at_trace_time_with_a_clear_error(tmp_path):
    workers = _two_workers("xla", tmp_path)
    for w in workers:
        assert w["losses"], "fit with jit_compile=True should have failed"
        assert "XLA" in w["losses"][0] and "jit_compile=False" in w["losses"][0]
