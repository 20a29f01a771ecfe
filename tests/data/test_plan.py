"""The step plan: every record exactly once per epoch, whatever the worker counts and rollbacks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticdl_strategy.coordinator.shards import DatasetSpec
from elasticdl_strategy.data.plan import BatchPolicy, EpochStream, next_cursor, rank_share, step_bounds
from elasticdl_strategy.errors import UsageError

POLICIES = st.one_of(
    st.builds(BatchPolicy, per_worker=st.integers(1, 9)), st.builds(BatchPolicy, global_batch=st.integers(1, 40))
)


@given(
    num_records=st.integers(1, 300),
    policy=POLICIES,
    shard_size=st.integers(1, 50),
    # (steps to take, workers) segments; a failure rolls back to the last commit before each segment.
    segments=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6), st.booleans()), min_size=1, max_size=6),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=200, deadline=None)
def test_every_record_once_per_epoch_under_changes_and_rollbacks(num_records, policy, shard_size, segments, seed):
    stream = EpochStream(*DatasetSpec(num_records, shard_size, seed).shards(epoch=0))
    used = np.zeros(num_records, np.int64)  # committed uses
    cursor = committed_cursor = 0
    pending = []
    for steps, workers, fails_after in segments:
        for _ in range(steps):
            if cursor >= num_records:
                break
            start, end = next(step_bounds(cursor, num_records, workers, policy))
            shares = [stream.indices(*rank_share(start, end, r, workers)) for r in range(workers)]
            if end - start >= workers:
                assert all(len(s) > 0 for s in shares), "a worker got an empty batch"
            pending.extend(np.concatenate(shares).tolist())
            cursor = end
            assert cursor == next_cursor(start, num_records, workers, policy)
        if fails_after:  # roll back: the records since the last commit are taken again
            cursor, pending = committed_cursor, []
        else:  # commit
            np.add.at(used, np.array(pending, np.int64), 1)
            committed_cursor, pending = cursor, []
    # Finish the epoch with one worker, then every record must have been used exactly once.
    while cursor < num_records:
        start, end = next(step_bounds(cursor, num_records, 1, policy))
        np.add.at(used, stream.indices(start, end), 1)
        cursor = end
    assert np.all(used == 1)


def test_the_last_few_records_are_folded_into_the_step_before():
    two = BatchPolicy(per_worker=2)
    assert list(step_bounds(0, 9, workers=2, policy=two)) == [(0, 4), (4, 9)]
    assert list(step_bounds(0, 10, workers=2, policy=two)) == [(0, 4), (4, 8), (8, 10)]
    assert [rank_share(4, 9, r, 2) for r in range(2)] == [(4, 6), (6, 9)]


def test_the_global_batch_is_the_batch_per_worker_times_the_workers():
    # Fixed batch per worker: 3 workers take 12 records a step, 2 workers 8.
    assert next(step_bounds(0, 100, workers=3, policy=BatchPolicy(per_worker=4))) == (0, 12)
    assert next(step_bounds(40, 100, workers=2, policy=BatchPolicy(per_worker=4))) == (40, 48)


@given(num_records=st.integers(1, 300), global_batch=st.integers(1, 40), cursor=st.integers(0, 300))
def test_a_fixed_global_batch_takes_the_same_steps_whatever_the_workers(num_records, global_batch, cursor):
    policy = BatchPolicy(global_batch=global_batch)
    steps = [list(step_bounds(cursor, num_records, workers, policy)) for workers in range(1, 7)]
    assert all(s == steps[0] for s in steps)
    assert all(end - start == global_batch for start, end in steps[0][:-1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "either a batch size per worker or a global batch size"),
        ({"per_worker": 2, "global_batch": 8}, "not both"),
        ({"per_worker": 0}, "batch_size=0 must be a positive integer"),
        ({"global_batch": 2.5}, "global_batch_size=2.5 must be a positive integer"),
    ],
)
def test_a_batch_policy_is_one_positive_size(kwargs, message):
    with pytest.raises(UsageError, match=message):
        BatchPolicy(**kwargs)


def test_epoch_stream_maps_positions_to_record_indices_across_shards():
    stream = EpochStream([10, 0], [15, 5])
    assert stream.num_records == 10
    assert stream.indices(3, 7).tolist() == [13, 14, 0, 1]
    assert stream.indices(5, 5).tolist() == []


def test_shards_are_index_ranges_reshuffled_per_epoch_with_the_seed():
    spec = DatasetSpec(num_records=1000, shard_size=10, seed=5)
    starts0, ends0 = spec.shards(0)
    assert sorted(zip(starts0.tolist(), ends0.tolist(), strict=True)) == [(s, s + 10) for s in range(0, 1000, 10)]
    assert np.array_equal(spec.shards(0)[0], starts0)  # deterministic
    assert not np.array_equal(spec.shards(1)[0], starts0)  # another order next epoch
    assert not np.array_equal(DatasetSpec(1000, 10, seed=6).shards(0)[0], starts0)
    assert DatasetSpec(1000, 10, shuffle=False).shards(3)[0].tolist() == list(range(0, 1000, 10))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"num_records": 0, "shard_size": 1}, "num_records=0"), ({"num_records": 5, "shard_size": 0}, "shard_size=0")],
)
def test_bad_dataset_specs_name_the_value(kwargs, message):
    with pytest.raises(UsageError, match=message):
        DatasetSpec(**kwargs)
