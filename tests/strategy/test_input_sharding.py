"""How each worker's input is cut from the dataset every worker builds: the decision per auto-shard
policy, the count of files a pipeline reads, the rows of a global batch, and numpy inputs to fit."""

import numpy as np
import pytest
import tensorflow as tf
from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

from elasticdl_strategy import runtime
from elasticdl_strategy.errors import UsageError
from elasticdl_strategy.strategy import input_sharding, keras_compat
from elasticdl_strategy.strategy.input_sharding import Sharding, count_files, plan, split_global_batches

Policy = tf.data.experimental.AutoShardPolicy


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("records")
    names = []
    for index in range(4):
        name = str(directory / f"part-{index}.tfrecord")
        with tf.io.TFRecordWriter(name) as writer:
            for record in range(3):
                writer.write(f"{index}-{record}".encode())
        names.append(name)
    return names


def with_policy(dataset, policy):
    return input_sharding.with_policy(dataset, policy)


def test_file_sources_are_counted_as_tensorflows_file_sharding_finds_them(files, tmp_path):
    pattern = files[0].replace("part-0", "part-*")
    assert count_files(tf.data.TFRecordDataset(files).map(tf.strings.length).batch(2)) == 4
    assert count_files(tf.data.TFRecordDataset(files[0]).batch(2)) == 1
    assert count_files(tf.data.TextLineDataset(files).batch(2)) == 4
    assert count_files(tf.data.experimental.CsvDataset(files, [tf.string]).batch(2)) == 4
    interleaved = tf.data.Dataset.list_files(pattern, shuffle=True).interleave(tf.data.TFRecordDataset)
    assert count_files(interleaved.shuffle(8).map(tf.strings.length).batch(2)) == 4
    assert count_files(tf.data.Dataset.range(8).batch(2)) is None  # no files
    two_sources = tf.data.Dataset.zip((tf.data.TFRecordDataset(files), tf.data.TextLineDataset(files)))
    assert count_files(two_sources) is None
    endless = tf.data.Dataset.from_tensor_slices(files).repeat().interleave(tf.data.TFRecordDataset)
    assert count_files(endless) is None  # a file list of unknown length


def test_the_policy_decides_as_the_module_docstring_says(files):
    records = tf.data.TFRecordDataset(files).batch(4)
    rows = tf.data.Dataset.range(8).batch(4)
    assert plan(records, 4) == plan(with_policy(records, Policy.AUTO), 4)  # AUTO is tf.data's default
    assert (plan(records, 4).sharding, plan(records, 4).policy) == (Sharding.TENSORFLOW, Policy.FILE)
    assert plan(records, 5).sharding is Sharding.ROWS  # fewer files than workers: DATA
    assert plan(rows, 2).sharding is Sharding.ROWS
    assert plan(with_policy(records, Policy.DATA), 2).sharding is Sharding.ROWS
    assert plan(with_policy(records, Policy.FILE), 4).policy == Policy.FILE
    assert plan(with_policy(rows, Policy.OFF), 2).policy == Policy.OFF
    assert plan(with_policy(rows, Policy.HINT), 2).policy == Policy.HINT
    assert plan(records, 1).sharding is Sharding.AS_IS
    with pytest.raises(UsageError, match="FILE needs a dataset that reads at least 5 files .* found 4 files"):
        plan(with_policy(records, Policy.FILE), 5)
    with pytest.raises(UsageError, match="found no file reader"):
        plan(with_policy(rows, Policy.FILE), 2)


def test_datasets_made_from_a_per_worker_dataset_are_taken_as_they_are():
    mine = input_sharding.mark_per_worker(tf.data.Dataset.range(8))
    derived = tf.data.Dataset.zip((mine, tf.data.Dataset.range(8))).batch(4).prefetch(1)
    assert plan(with_policy(derived, Policy.DATA), 3).sharding is Sharding.AS_IS
    assert plan(tf.data.Dataset.range(8).batch(4), 3).sharding is Sharding.ROWS  # others are not


def test_rows_of_a_global_batch_are_split_like_np_array_split():
    dataset = tf.data.Dataset.from_tensor_slices((np.arange(13), np.arange(13) * 10)).batch(10)
    for rank in range(3):
        got = [(x.numpy().tolist(), y.numpy().tolist()) for x, y in split_global_batches(dataset, rank, 3)]
        expected = [np.array_split(np.arange(10), 3)[rank], np.array_split(np.arange(10, 13), 3)[rank]]
        assert [x for x, _ in got] == [e.tolist() for e in expected]
        assert [y for _, y in got] == [(e * 10).tolist() for e in expected]


def test_numpy_inputs_gather_only_this_workers_rows(monkeypatch):
    # Keras gathers the rows of each batch in its dataset; each worker must gather only its share.
    x, y = np.arange(26, dtype=np.float32)[:, None], np.arange(26)
    build = keras_compat._only_this_workers_rows(ArrayDataAdapter.get_tf_dataset)
    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "size", lambda: 3)
    shares = []
    for rank in range(3):
        monkeypatch.setattr(runtime, "rank", lambda: rank)
        dataset = build(ArrayDataAdapter(x, y, batch_size=10, shuffle=False))
        assert plan(dataset, 3).sharding is Sharding.AS_IS
        shares.append([(bx.numpy()[:, 0].tolist(), by.numpy().tolist()) for bx, by in dataset])
    for step in range(3):  # 10, 10 and 6 rows: 4/3/3, 4/3/3, 2/2/2
        rows = [shares[rank][step][0] for rank in range(3)]
        assert [len(r) for r in rows] == [len(s) for s in np.array_split(np.arange(10 if step < 2 else 6), 3)]
        assert sum(rows, []) == list(range(10 * step, min(26, 10 * step + 10)))
        assert all(shares[rank][step][0] == shares[rank][step][1] for rank in range(3))  # x with its y
    assert tf.data.Dataset.zip is vars(tf.data.Dataset)["zip"].__func__  # put back as it was
