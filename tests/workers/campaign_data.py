"""The campaign's records, shared by tests/elastic/test_campaign.py (which writes them to TFRecord
files) and its worker (which reads them from memory by index, or from those files)."""

import numpy as np
import tensorflow as tf


def dataset_arrays(num_records: int):
    """Features (float64, 4 per record) and labels (0..2) of the job's records."""
    rng = np.random.default_rng(7)
    return rng.standard_normal((num_records, 4)), rng.integers(0, 3, num_records)


def serialize(index: int, features: np.ndarray, label: int) -> bytes:
    """Record ``index`` as a ``tf.train.Example``: its index, features and label."""
    feature = {
        "index": tf.train.Feature(int64_list=tf.train.Int64List(value=[index])),
        "features": tf.train.Feature(float_list=tf.train.FloatList(value=features)),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def parse(record):
    """A serialized record as the worker's model takes it: ``((features, index), label)``."""
    spec = {
        "index": tf.io.FixedLenFeature([], tf.int64),
        "features": tf.io.FixedLenFeature([4], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    example = tf.io.parse_single_example(record, spec)
    return (tf.cast(example["features"], tf.float64), example["index"]), example["label"]
