"""Datasets read from files under every auto-shard policy, at N = 2 through the real launcher: which
records each worker parses, and that every record trains exactly as often as the policy says."""

import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.launch import read_reports, run_job, worker_script

pytestmark = pytest.mark.slow

FILE_RECORDS = [12, 9, 10, 7, 10]  # uneven on purpose: at N = 2 FILE gives the workers 32 and 16
EPOCHS = 2


def write_files(directory) -> int:
    rng = np.random.default_rng(0)
    record_id = 0
    for index, count in enumerate(FILE_RECORDS):
        with tf.io.TFRecordWriter(str(directory / f"part-{index:02d}.tfrecord")) as writer:
            for _ in range(count):
                x = rng.standard_normal(4).astype(np.float32)
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[record_id])),
                            "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x[0] > 0)])),
                        }
                    )
                )
                writer.write(example.SerializeToString())
                record_id += 1
    (directory / "RECORDS").write_text(str(record_id))
    return record_id


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    files, results = tmp_path_factory.mktemp("files"), tmp_path_factory.mktemp("results")
    records = write_files(files)
    job = run_job(2, [sys.executable, worker_script("strategy_file_inputs.py"), str(results), str(files)], timeout=280)
    assert job.returncode == 0, job.stderr[-3000:]
    return records, read_reports(results, range(2))


def file_ids(indices):
    starts = np.cumsum([0] + FILE_RECORDS)
    return np.concatenate([np.arange(starts[i], starts[i + 1]) for i in indices])


def uses(workers, scenario):
    """Per epoch, per record: how often all workers together trained on it in that epoch."""
    cumulative = np.sum([np.array(w[scenario]["counts"]) for w in workers], axis=0)
    return np.diff(cumulative, axis=0, prepend=0)


def parsed_in_last_epoch(worker, scenario):
    """Records parsed in the last epoch (in the first, Keras also builds the model from a first batch
    of an iterator it then drops, which may have read ahead)."""
    return np.diff(worker[scenario]["parsed"])[-1]


@pytest.mark.parametrize("scenario", ["auto", "auto_list_files", "file"])
def test_file_sharding_parses_each_record_on_one_worker_and_trains_it_once(reports, scenario):
    records, workers = reports
    np.testing.assert_array_equal(uses(workers, scenario), 1)  # every record once per epoch, through uneven files
    for rank, worker in enumerate(workers):
        assert parsed_in_last_epoch(worker, scenario) == len(file_ids(range(rank, 5, 2)))
    if scenario != "auto_list_files":  # in file order: worker r read files r, r + 2, ...
        for rank, worker in enumerate(workers):
            trained = np.flatnonzero(np.array(worker[scenario]["counts"][0]))
            np.testing.assert_array_equal(trained, file_ids(range(rank, 5, 2)))
    assert workers[0][scenario]["weights"] == workers[1][scenario]["weights"]


@pytest.mark.parametrize("scenario", ["data", "auto_one_file"])
def test_data_sharding_keeps_each_workers_rows_of_every_global_batch(reports, scenario):
    records, workers = reports
    n = records if scenario == "data" else FILE_RECORDS[0]
    np.testing.assert_array_equal(uses(workers, scenario)[:, :n], 1)
    np.testing.assert_array_equal(uses(workers, scenario)[:, n:], 0)
    for worker in workers:  # the pipeline before the batch runs on every record on every worker
        assert parsed_in_last_epoch(worker, scenario) == n
    first_epoch = [np.flatnonzero(np.array(w[scenario]["counts"][0])) for w in workers]
    batches = np.array_split(np.arange(n), np.arange(8, n, 8))  # global batches of 8: rows 0-3 to rank 0
    np.testing.assert_array_equal(first_epoch[0], np.concatenate([b[: (len(b) + 1) // 2] for b in batches]))
    assert workers[0][scenario]["weights"] == workers[1][scenario]["weights"]


def test_data_sharding_of_records_of_known_number_parses_only_each_workers_rows(reports):
    records, workers = reports  # 48 records in batches of 8: 4 of each batch to each worker
    np.testing.assert_array_equal(uses(workers, "data_in_memory"), 1)
    for rank, worker in enumerate(workers):
        assert parsed_in_last_epoch(worker, "data_in_memory") == records // 2
        trained = np.flatnonzero(np.array(worker["data_in_memory"]["counts"][0]))
        np.testing.assert_array_equal(trained % 8 // 4, rank)  # rows 0-3 of every batch to rank 0
    assert workers[0]["data_in_memory"]["weights"] == workers[1]["data_in_memory"]["weights"]


def test_hint_shards_where_the_pipeline_says(reports):
    records, workers = reports
    n = FILE_RECORDS[0]
    np.testing.assert_array_equal(uses(workers, "hint")[:, :n], 1)
    for worker in workers:
        assert parsed_in_last_epoch(worker, "hint") == n // 2


def test_off_gives_every_worker_everything_in_batches_split_in_two(reports):
    records, workers = reports
    n = FILE_RECORDS[0]
    for worker in workers:
        assert parsed_in_last_epoch(worker, "off") == n
        per_epoch = np.diff(np.array(worker["off"]["counts"]), axis=0, prepend=0)
        np.testing.assert_array_equal(per_epoch[:, :n], 1)


def test_file_policy_without_enough_files_is_a_clear_error(reports):
    records, workers = reports
    for worker in workers:
        error = worker["file_one_file"]["error"]
        assert "FILE needs a dataset that reads at least 2 files" in error and "found 1 files" in error
