"""DATA sharding that chooses each worker's rows before the per-record maps: the same batches as taking
the rows from each global batch, made from 1/N of the records; left alone where that cannot hold."""

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_strategy.strategy.input_sharding import split_global_batches
from elasticdl_strategy.strategy.rows_before_maps import rows_before_maps


def as_lists(dataset):
    return [tf.nest.map_structure(lambda t: t.numpy().tolist(), element) for element in dataset]


PIPELINES = {
    "map": lambda: tf.data.Dataset.range(26).map(lambda x: x * 10).batch(10),
    "seeded shuffle, parallel map, prefetch, map and prefetch after": lambda: (
        tf.data.Dataset.from_tensor_slices((np.arange(26), np.arange(26) * 2.0))
        .shuffle(26, seed=1)
        .map(lambda x, y: (x + 1, y * 3), num_parallel_calls=4)
        .prefetch(2)
        .batch(10)
        .map(lambda a, b: (a, b + 1))
        .prefetch(1)
    ),
    "nested structure, drop_remainder, repeat": lambda: (
        tf.data.Dataset.range(26).map(lambda x: {"a": x, "b": [x, x]}).batch(10, drop_remainder=True).repeat(2)
    ),
    "options, take and skip": lambda: (
        tf.data.Dataset.range(40).map(lambda x: x + 1).with_options(tf.data.Options()).batch(8).skip(1).take(3)
    ),
}


@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize("size", [2, 3])
def test_the_batches_are_those_of_the_row_split(name, size):
    for rank in range(size):
        rewritten = rows_before_maps(PIPELINES[name](), rank, size)
        assert rewritten is not None
        assert as_lists(rewritten) == as_lists(split_global_batches(PIPELINES[name](), rank, size))


def test_each_worker_runs_the_maps_on_its_rows_only():
    calls = tf.Variable(0, dtype=tf.int64)

    def counted(x):
        calls.assign_add(1)
        return x

    for rank, expected in enumerate([4 + 4 + 2, 3 + 3 + 2, 3 + 3 + 2]):  # 26 rows in batches of 10, 10, 6
        calls.assign(0)
        batches = as_lists(rows_before_maps(tf.data.Dataset.range(26).map(counted).batch(10), rank, 3))
        assert int(calls.numpy()) == expected == sum(len(b) for b in batches)


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda: tf.data.Dataset.range(26).batch(10),  # no map: nothing to save
        lambda: tf.data.Dataset.range(26).filter(lambda x: x > 2).map(lambda x: x).batch(10),  # length unknown
        lambda: tf.data.Dataset.range(21).map(lambda x: x).batch(10),  # a last batch of 1 for 3 workers
        lambda: tf.data.Dataset.range(26).map(lambda x: x).batch(10).unbatch().batch(5),  # unbatch after
        lambda: tf.data.Dataset.range(26).map(lambda x: x).batch(10).shuffle(3),  # shuffled batches
        lambda: tf.data.Dataset.range(26).map(lambda x: x).repeat().batch(10),  # endless
    ],
)
def test_pipelines_it_cannot_keep_equal_are_left_to_the_row_split(pipeline):
    assert rows_before_maps(pipeline(), 0, 3) is None
