"""Sparse (embedding) gradients: all-gathered rows by default, or dense with sparse_as_dense=True;
both train like one process on the global batch."""

import sys

import numpy as np
import pytest

from tests.launch import read_reports, run_alone, run_job, worker_script

pytestmark = pytest.mark.slow


def _reference(tmp_path):
    out = tmp_path / "one"
    out.mkdir()
    result = run_alone([sys.executable, worker_script("strategy_sparse.py"), "sparse", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return read_reports(out, [0])[0]


# Per step with 2 workers (these all-reduces are small: a direct exchange, N-1 = 1 message each;
# an all-gather is a ring step for the row counts and one for the data, 2(N-1) = 2 messages):
#   dense:  one fused all-reduce of embedding + dense kernel + bias, one of the loss      -> 2 x 1
#   sparse: one fused all-reduce of kernel + bias (1), two all-gathers of the embedding's
#           indices and rows (2 x 2), one all-reduce of the loss (1)                      -> 6
MESSAGES_PER_STEP = {"dense": 2, "sparse": 6}


@pytest.mark.parametrize("reduction", ["sparse", "dense"])
def test_embedding_gradients_match_one_process(tmp_path, reduction):
    reference = _reference(tmp_path)
    out = tmp_path / reduction
    out.mkdir()
    job = run_job(2, [sys.executable, worker_script("strategy_sparse.py"), reduction, str(out)], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    workers = read_reports(out, range(2))
    assert workers[0]["embedding_gradient"] == "IndexedSlices"
    assert workers[0]["messages_per_step"] == MESSAGES_PER_STEP[reduction]
    assert workers[0]["weights"] == workers[1]["weights"]
    for ours, theirs in zip(workers[0]["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
    np.testing.assert_allclose(workers[0]["losses"], reference["losses"], rtol=1e-12)
