"""Keras `model.fit` on N workers with AllReduceStrategy — unchanged model code.

Run on 2 local workers::

    elasticdl-strategy run --workers 2 -- python examples/train_keras.py

Every worker reads the same dataset of global batches; the strategy gives
each worker its share of every batch and all-reduces the gradients, so the
model trains as one process would on the global batch.
"""

import argparse
import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, collective


def make_dataset(samples: int, global_batch: int) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, 16)).astype("float32")
    y = (np.sin(x[:, :4]).sum(axis=1, keepdims=True) + 0.05 * rng.standard_normal((samples, 1))).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(samples, seed=0).batch(global_batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    strategy = AllReduceStrategy()
    rank = collective.rank()
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")

    dataset = make_dataset(args.samples, args.global_batch)
    before = model.evaluate(dataset, verbose=0)  # over all workers' rows
    model.fit(dataset, epochs=args.epochs, verbose=2 if rank == 0 else 0)
    after = model.evaluate(dataset, verbose=0)
    if rank == 0:
        print(f"{strategy.num_replicas_in_sync} workers: mse {before:.4f} -> {after:.4f}")
    collective.shutdown()
    return 0 if after < before / 4 else 1


if __name__ == "__main__":
    sys.exit(main())
