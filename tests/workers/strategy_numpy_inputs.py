"""Worker of tests/strategy/test_numpy_inputs.py: Keras ``fit`` on numpy arrays with Keras' default
``shuffle=True``, ``validation_split`` and ``class_weight``; a layer counts which rows trained.

Usage: strategy_numpy_inputs.py RESULTS_DIR SHUFFLE   (SHUFFLE: true or batch)
Writes ``{results_dir}/rank{r}.json``: this worker's per-row use counts after every epoch, and the
rows of the first batch of every epoch.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report

ROWS = 120  # 96 train and 24 validation rows with validation_split=0.2
BATCH = 16
EPOCHS = 3


class RowCounter(keras.layers.Layer):
    """Passes features through; while training, counts every row id (column 0) it sees."""

    def build(self, shape):
        self.counts = self.add_weight(shape=(ROWS,), initializer="zeros", trainable=False, name="counts")
        self.first = self.add_weight(shape=(BATCH,), initializer="zeros", trainable=False, name="first")

    def call(self, x, training=False):
        if training:
            ids = tf.cast(x[:, 0], tf.int32)
            self.counts.assign_add(tf.math.bincount(ids, minlength=ROWS, maxlength=ROWS, dtype=self.counts.dtype))
            padded = tf.pad(tf.cast(ids, self.first.dtype), [[0, BATCH - tf.shape(ids)[0]]], constant_values=-1)
            self.first.assign(padded)  # the last batch's rows (read after the first batch below)
        return x[:, 1:]


def main(results_dir: str, shuffle: str) -> None:
    strategy = AllReduceStrategy()
    rng = np.random.default_rng(0)
    features = rng.standard_normal((ROWS, 4))
    x = np.concatenate([np.arange(ROWS)[:, None], features], axis=1).astype("float32")
    y = (features[:, 0] > 0).astype("int64")
    with strategy.scope():
        counter = RowCounter()
        model = keras.Sequential([keras.Input((5,)), counter, keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counts, firsts = [], []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                firsts.append(counter.first.numpy().tolist())

        def on_epoch_end(self, epoch, logs=None):
            counts.append(counter.counts.numpy().tolist())

    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=True if shuffle == "true" else shuffle,
        validation_split=0.2,
        class_weight={0: 1.0, 1: 2.0},
        callbacks=[Record()],
        verbose=0,
    )
    report = {
        "rank": runtime.rank(),
        "counts": counts,
        "firsts": firsts,
        "val_loss": history.history["val_loss"],
        "weights": [w.numpy().ravel().tolist() for w in model.trainable_weights],
    }
    write_report(results_dir, runtime.rank(), report)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
