"""ElasticRecords on a single worker (no coordinator): batches, advancing, epochs."""

import numpy as np
import pytest

from elasticdl_strategy.data import ElasticRecords, Position
from elasticdl_strategy.errors import UsageError

pytestmark = pytest.mark.usefixtures("single_worker")


def test_an_epoch_of_batches_covers_every_record_once_and_advance_moves_to_the_next_epoch():
    records = ElasticRecords(num_records=23, batch_size=5, shard_size=4, seed=1)
    batches = [b.numpy() for b in records.dataset()]
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
    assert sorted(np.concatenate(batches).tolist()) == list(range(23))
    for expected_batch in range(1, 5):
        records.advance()
        assert records.position.batch == expected_batch and records.epoch == 0
    records.advance()
    assert records.position == Position(epoch=1, batch=0, cursor=0)
    # The next epoch reads the records in another shard order.
    assert not np.array_equal(np.concatenate(list(records.batches())), np.concatenate(batches))


def test_a_dataset_resumes_from_the_position():
    records = ElasticRecords(num_records=20, batch_size=5, seed=2)
    everything = np.concatenate(list(records.batches()))
    records.advance()
    records.advance()
    rest = np.concatenate([b.numpy() for b in records.dataset()])
    assert rest.tolist() == everything[10:].tolist()
    assert records.steps_left_in_epoch() == 2


def test_bad_batch_size_is_refused():
    with pytest.raises(UsageError, match="batch_size=0"):
        ElasticRecords(num_records=10, batch_size=0)


def test_the_index_dataset_and_what_is_made_from_it_run_without_tf_data_autotuning():
    # An autotuned iterator deleted when a failure ends the loop waited for its tuning thread's
    # next period (up to 10 s) before the worker could recover.
    records = ElasticRecords(num_records=20, batch_size=5, seed=2)
    dataset = records.dataset()
    assert dataset.options().autotune.enabled is False
    assert dataset.map(lambda i: i * 2).batch(2).options().autotune.enabled is False


def test_one_index_dataset_serves_every_iteration_from_the_position_at_its_start():
    # Made once: a training function called again after a re-formation does not build it again.
    records = ElasticRecords(num_records=20, batch_size=5, shard_size=4, seed=2)
    dataset = records.dataset()
    assert records.dataset() is dataset
    everything = np.concatenate([b.numpy() for b in dataset])
    records.advance()
    assert np.concatenate([b.numpy() for b in dataset]).tolist() == everything[5:].tolist()
    for _ in range(3):
        records.advance()
    next_epoch = np.concatenate([b.numpy() for b in dataset])  # the next epoch's order
    assert sorted(next_epoch.tolist()) == list(range(20)) and next_epoch.tolist() != everything.tolist()


def test_an_index_dataset_made_while_tracing_belongs_to_that_graph():
    import tensorflow as tf

    records = ElasticRecords(num_records=20, batch_size=5, seed=2)
    eager = records.dataset()

    @tf.function
    def first_batch():
        return next(iter(records.dataset()))

    assert first_batch().numpy().tolist() == next(iter(eager)).numpy().tolist()
    assert records.dataset() is eager
