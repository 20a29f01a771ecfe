"""Sparse (embedding) gradients, ids repeated within a batch: all-gathered rows by default, or
dense with sparse_as_dense=True; both train like one process on the global batch, with every
Keras optimizer whose sparse update is not linear (Adam, Adagrad and RMSprop square each row)."""

import sys

import numpy as np
import pytest

from tests.launch import read_reports, run_alone, run_job, worker_script

pytestmark = pytest.mark.slow

# Sparse: every optimizer. Dense: one linear and one squaring optimizer (the reduction is the same).
OPTIMIZERS = {"sparse": ["sgd", "adam", "adagrad", "rmsprop"], "dense": ["sgd", "adam"]}

# Collectives per step:
#   dense:  one fused all-reduce of embedding + dense kernel + bias, one of the loss       -> 2
#   sparse: one fused all-reduce of kernel + bias, two all-gathers of the embedding's
#           indices and rows, one all-reduce of the loss                                   -> 4
COLLECTIVES_PER_STEP = {"dense": 2, "sparse": 4}


def _run(reduction, out, workers):
    out.mkdir()
    command = [sys.executable, worker_script("strategy_sparse.py"), reduction, str(out), *OPTIMIZERS[reduction]]
    result = run_alone(command, timeout=240) if workers == 1 else run_job(workers, command, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_reports(out, range(workers))


@pytest.mark.parametrize("reduction", ["sparse", "dense"])
def test_embedding_gradients_match_one_process(tmp_path, reduction):
    # The reference for sparse_as_dense applies the densified gradient (the optimizer's dense
    # update), which for Adam, Adagrad and RMSprop is another model than the sparse update.
    (reference,) = _run(reduction, tmp_path / "one", 1)
    workers = _run(reduction, tmp_path / "two", 2)
    for name in OPTIMIZERS[reduction]:
        ours, theirs = workers[0][name], reference[name]
        assert ours["embedding_gradient"] == "IndexedSlices"
        assert ours["collectives_per_step"] == COLLECTIVES_PER_STEP[reduction]
        assert workers[1][name]["weights"] == ours["weights"], name
        for a, b in zip(ours["weights"], theirs["weights"], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-9, err_msg=name)
        np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-9, err_msg=name)
