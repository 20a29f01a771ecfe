"""numpy inputs to fit with Keras' default shuffle=True: every training row is used exactly once per
epoch across the workers, in a new order every epoch, the same on every worker; validation_split and
class_weight keep working. A layer of the model counts the rows it trains on."""

import sys

import numpy as np
import pytest

from tests.launch import read_reports, run_job, worker_script

pytestmark = pytest.mark.slow

TRAIN_ROWS = 96  # the first 80 % of 120: Keras takes validation_split from the end


@pytest.mark.parametrize("n, shuffle", [(3, "true"), (2, "batch")])  # 16-row batches: 6/5/5 rows at N = 3
def test_every_row_once_per_epoch_in_a_new_order(tmp_path, n, shuffle):
    job = run_job(n, [sys.executable, worker_script("strategy_numpy_inputs.py"), str(tmp_path), shuffle], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    workers = read_reports(tmp_path, range(n))
    totals = np.sum([np.array(w["counts"]) for w in workers], axis=0)  # (epoch, row) over all workers
    for epoch, counts in enumerate(totals, start=1):
        np.testing.assert_array_equal(counts[:TRAIN_ROWS], epoch)  # each training row once per epoch
        np.testing.assert_array_equal(counts[TRAIN_ROWS:], 0)  # validation rows never trained
    firsts = [w["firsts"] for w in workers]
    assert firsts[0][0] != firsts[0][1] != firsts[0][2]  # a new order every epoch
    assert all(w["weights"] == workers[0]["weights"] for w in workers)
    assert all(len(w["val_loss"]) == 3 and np.all(np.isfinite(w["val_loss"])) for w in workers)


@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_the_order_does_not_depend_on_how_far_a_discarded_iterator_prefetched(monkeypatch, shuffle):
    # A worker's peek at the first batch (Keras does one before training) may compute more batches
    # than it takes, as far as its prefetching got: the orders after it must not depend on that.
    import inspect

    import tensorflow as tf
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    from elasticdl_strategy import runtime
    from elasticdl_strategy.strategy import keras_compat

    class RankZeroSeed:
        def broadcast(self, array, root=0):
            return np.array([12345], np.int64)

    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "size", lambda: 2)
    monkeypatch.setattr(runtime, "communicator", RankZeroSeed)
    get_tf_dataset = keras_compat._shuffled_alike_on_every_worker(inspect.unwrap(ArrayDataAdapter.get_tf_dataset))
    rows = np.arange(64, dtype=np.float32)[:, None]

    def epochs_after_a_peek(peeked: int):
        dataset = get_tf_dataset(ArrayDataAdapter(rows, batch_size=8, shuffle=shuffle))
        peek = iter(dataset)
        for _ in range(peeked):  # the batches the discarded iterator computed
            next(peek)
        del peek
        return [[int(r) for batch in dataset for r in np.ravel(tf.nest.flatten(batch)[0])] for _ in range(2)]

    one, several = epochs_after_a_peek(1), epochs_after_a_peek(5)
    assert one == several
    assert one[0] != one[1] and sorted(one[0]) == sorted(one[1]) == list(range(64))
