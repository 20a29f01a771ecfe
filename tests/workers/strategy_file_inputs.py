"""Worker of tests/strategy/test_file_inputs.py: Keras ``fit`` on TFRecord files under each
auto-shard policy; a layer counts which records trained, a counter in ``map`` which were parsed.

Usage: strategy_file_inputs.py RESULTS_DIR FILES_DIR
Every file ``FILES_DIR/*.tfrecord`` holds ``tf.train.Example``s with an int64 ``id`` (0 .. RECORDS-1
over all files), float ``x`` (4) and int64 ``y``. Writes ``{results_dir}/rank{r}.json``: per
scenario, this worker's per-record use counts after every epoch and its records parsed per epoch.
"""

import glob
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from elasticdl_strategy.errors import UsageError
from tests.workers.report import write_report

BATCH = 8
EPOCHS = 2
Policy = tf.data.experimental.AutoShardPolicy


def parse_counting(parsed: tf.Variable):
    def parse(record):
        parsed.assign_add(1)
        features = tf.io.parse_single_example(
            record,
            {
                "id": tf.io.FixedLenFeature([], tf.int64),
                "x": tf.io.FixedLenFeature([4], tf.float32),
                "y": tf.io.FixedLenFeature([], tf.int64),
            },
        )
        row = tf.concat([tf.cast(features["id"], tf.float32)[None], features["x"]], axis=0)
        return row, features["y"]

    return parse


def source(files, kind: str) -> tf.data.Dataset:
    if kind == "list_files":  # the file names as a dataset, interleaved: the ImageNet-style pipeline
        names = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files))  # unseeded: FILE shards first
        return names.interleave(tf.data.TFRecordDataset, cycle_length=2)
    if kind == "memory":  # the records read beforehand: a dataset of known length
        return tf.data.Dataset.from_tensor_slices([r.numpy() for r in tf.data.TFRecordDataset(files)])
    if kind == "hint":
        return tf.data.TFRecordDataset(files).shard(tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT)
    return tf.data.TFRecordDataset(files)


def train(files, kind: str, policy, records: int) -> dict:
    strategy = AllReduceStrategy()
    with strategy.scope():
        counts = tf.Variable(tf.zeros(records, tf.int32), trainable=False)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Lambda(lambda x: x[:, 1:]), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    parsed = tf.Variable(0, dtype=tf.int64, trainable=False)

    original_train_step = model.train_step

    def train_step(data):  # counts the record ids of this worker's batch, then trains on it
        x, _ = data
        counts.assign_add(tf.math.bincount(tf.cast(x[:, 0], tf.int32), minlength=records, maxlength=records))
        return original_train_step(data)

    model.train_step = train_step
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    dataset = source(files, kind).map(parse_counting(parsed)).batch(BATCH).with_options(options)
    per_epoch_counts, per_epoch_parsed = [], []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            per_epoch_counts.append(counts.numpy().tolist())
            per_epoch_parsed.append(int(parsed.numpy()))

    try:
        model.fit(dataset, epochs=EPOCHS, callbacks=[Record()], verbose=0)
    except UsageError as e:
        return {"error": str(e)}
    return {
        "counts": per_epoch_counts,
        "parsed": per_epoch_parsed,
        "weights": [w.numpy().ravel().tolist() for w in model.trainable_weights],
    }


def main(results_dir: str, files_dir: str) -> None:
    files = sorted(glob.glob(os.path.join(files_dir, "*.tfrecord")))
    records = int(open(os.path.join(files_dir, "RECORDS")).read())
    scenarios = {
        "auto": (files, "list", Policy.AUTO),
        "auto_list_files": (files, "list_files", Policy.AUTO),
        "file": (files, "list", Policy.FILE),
        "hint": (files[:1], "hint", Policy.HINT),
        "data": (files, "list", Policy.DATA),
        "data_in_memory": (files, "memory", Policy.AUTO),
        "auto_one_file": (files[:1], "list", Policy.AUTO),
        "off": (files[:1], "list", Policy.OFF),
        "file_one_file": (files[:1], "list", Policy.FILE),
    }
    runtime.init()
    report = {"rank": runtime.rank(), "size": runtime.size()}
    for name, (names, kind, policy) in scenarios.items():
        report[name] = train(names, kind, policy, records)
    write_report(results_dir, runtime.rank(), report)
    runtime.shutdown()


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main(sys.argv[1], sys.argv[2])
