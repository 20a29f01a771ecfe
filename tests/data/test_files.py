"""ElasticFiles: TFRecord and text files read by record, each record once per epoch, from any position;
what every rank of a job reads (its shares only, through map_fn); record counts counted and cached."""

import json

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_strategy.data import ElasticFiles
from elasticdl_strategy.data.plan import BatchPolicy, rank_share, step_bounds
from elasticdl_strategy.errors import UsageError

COUNTS = [7, 0, 12, 5, 9]  # an empty file among them: 33 records


pytestmark = pytest.mark.usefixtures("single_worker")


@pytest.fixture
def tfrecords(tmp_path):
    names, record = [], 0
    for index, count in enumerate(COUNTS):
        name = str(tmp_path / f"part-{index}.tfrecord")
        with tf.io.TFRecordWriter(name) as writer:
            for _ in range(count):
                writer.write(str(record).encode())
                record += 1
        names.append(name)
    return names


@pytest.fixture
def csv_files(tmp_path):
    names, record = [], 0
    for index, count in enumerate(COUNTS):
        name = tmp_path / f"part-{index}.csv"
        name.write_text("id,square\n" + "".join(f"{r},{r * r}\n" for r in range(record, record + count)))
        record += count
        names.append(str(name))
    return names


def as_int(record):
    return tf.strings.to_number(record, tf.int64)


def ids(dataset):
    return [batch.numpy().tolist() for batch in dataset]


def test_an_epoch_reads_every_record_once_through_map_fn_and_the_next_in_another_order(tfrecords):
    files = ElasticFiles(tfrecords, batch_size=4, shard_size=5, seed=3)
    assert files.num_records == sum(COUNTS) and files.record_counts == COUNTS
    first = ids(files.dataset(as_int))
    assert [len(b) for b in first] == [4] * 8 + [1]
    assert sorted(sum(first, [])) == list(range(33))
    for _ in first:
        files.advance()
    assert files.epoch == 1
    second = ids(files.dataset(as_int))
    assert sorted(sum(second, [])) == list(range(33)) and second != first


def test_a_dataset_resumes_mid_file_at_the_position(tfrecords):
    files = ElasticFiles(tfrecords, batch_size=4, shard_size=5, seed=3)
    everything = sum(ids(files.dataset(as_int)), [])
    for _ in range(3):
        files.advance()
    assert sum(ids(files.dataset(as_int)), []) == everything[12:]


def test_each_rank_reads_its_shares_of_the_records_in_order_and_runs_map_fn_on_those_alone(tfrecords):
    files = ElasticFiles(tfrecords, batch_size=3, shard_size=4, seed=5)
    order = sum(ids(files.dataset(as_int)), [])  # the epoch's stream on one worker
    files.advance()
    files.advance()  # resume after 2 steps of one worker: cursor 6
    cursor, size = files.position.cursor, 3
    for rank in range(size):
        plan = files.plan(rank, size)
        stream = order[cursor:]
        kept = [r for r, mine in zip(stream, plan.mine, strict=True) if mine]
        steps = step_bounds(cursor, 33, size, BatchPolicy(per_worker=3))
        expected = [order[lo:hi] for lo, hi in (rank_share(s, e, rank, size) for s, e in steps)]
        assert kept == sum(expected, [])
        assert plan.sizes.tolist() == [len(e) for e in expected if e]
        read = [list(range(f0 + o, f0 + o + c)) for f0, o, c in zip(
            np.cumsum([0] + COUNTS)[plan.file_ids], plan.offsets, plan.counts, strict=True)]  # fmt: skip
        assert sum(read, []) == stream  # the runs read are the stream from the cursor


def test_csv_lines_after_their_headers_with_a_parser(csv_files):
    files = ElasticFiles(csv_files, batch_size=5, format="text", header_lines=1, seed=1)
    assert files.record_counts == COUNTS

    def parse(line):
        record, square = tf.io.decode_csv(line, [tf.constant(0, tf.int64), tf.constant(0, tf.int64)])
        return {"id": record, "square": square}

    batches = list(files.dataset(parse))
    got = np.concatenate([b["id"].numpy() for b in batches])
    assert sorted(got.tolist()) == list(range(33))
    np.testing.assert_array_equal(np.concatenate([b["square"].numpy() for b in batches]), got * got)


def test_counts_are_cached_by_path_size_and_time_and_refreshed_when_a_file_changes(tfrecords, tmp_path):
    cache = tmp_path / "counts.json"
    assert ElasticFiles(tfrecords, batch_size=2, counts_cache=str(cache)).record_counts == COUNTS
    cached = json.loads(cache.read_text())
    assert sorted(cached.values()) == sorted(COUNTS)
    poisoned = {key: count + 100 for key, count in cached.items()}  # proof that the cache is what is read
    cache.write_text(json.dumps(poisoned))
    assert ElasticFiles(tfrecords, batch_size=2, counts_cache=str(cache)).record_counts == [c + 100 for c in COUNTS]
    with tf.io.TFRecordWriter(tfrecords[1]) as writer:  # the empty file now holds 2 records
        writer.write(b"33")
        writer.write(b"34")
    counts = ElasticFiles(tfrecords, batch_size=2, counts_cache=str(cache)).record_counts
    assert counts[1] == 2 and counts[0] == COUNTS[0] + 100


def test_the_fingerprint_names_the_files_and_counts(tfrecords):
    a = ElasticFiles(tfrecords, batch_size=2).spec
    assert a == ElasticFiles(tfrecords, batch_size=2, record_counts=COUNTS).spec
    assert a.fingerprint != ElasticFiles(tfrecords[::-1], batch_size=2).spec.fingerprint


def test_bad_arguments_are_one_line_errors(tfrecords, tmp_path):
    with pytest.raises(UsageError, match="non-empty list"):
        ElasticFiles("one.tfrecord", batch_size=2)
    with pytest.raises(UsageError, match="format='parquet'"):
        ElasticFiles(tfrecords, batch_size=2, format="parquet")
    with pytest.raises(UsageError, match="cannot read .*missing"):
        ElasticFiles([str(tmp_path / "missing")], batch_size=2)
    with pytest.raises(UsageError, match="one non-negative count per file"):
        ElasticFiles(tfrecords, batch_size=2, record_counts=[1, 2])
    with pytest.raises(UsageError, match="hold no records"):
        ElasticFiles([tfrecords[1]], batch_size=2)
