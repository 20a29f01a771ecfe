"""Keras compile/fit/evaluate on N workers with AllReduceStrategy — unchanged model code.

Run on 2 local workers::

    elasticdl-strategy run --workers 2 -- python examples/keras_fit.py

The data (4 Gaussian classes in 16 dimensions) is generated, so nothing is
downloaded. Every worker reads the same dataset of *global* batches; the
strategy gives each worker its share of every batch and all-reduces the
gradients, so the model trains as one process would on the global batch.
Target: test accuracy >= 0.95 (the script exits 1 below it).
"""

import argparse
import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime

TARGET_ACCURACY = 0.95


def make_data(samples: int, seed: int):
    """Four classes around well-separated centres, plus noise."""
    centres = np.random.default_rng(0).normal(0.0, 2.0, size=(4, 16))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, samples)
    features = centres[labels] + rng.normal(0.0, 1.5, size=(samples, 16))
    return features.astype("float32"), labels.astype("int64")


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8192)
    return parser.parse_args()


def build_model() -> keras.Model:
    """A small classifier of the 16-dimensional points into 4 classes (logits)."""
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    strategy = AllReduceStrategy()
    rank = runtime.rank()
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    # The same shuffled global batches on every worker (seeded shuffle).
    train = tf.data.Dataset.from_tensor_slices(make_data(args.samples, seed=1))
    train = train.shuffle(args.samples, seed=0).batch(args.global_batch)
    test = tf.data.Dataset.from_tensor_slices(make_data(2048, seed=2)).batch(args.global_batch)

    model.fit(train, epochs=args.epochs, verbose=2)  # printed by rank 0 only
    loss, accuracy = model.evaluate(test, verbose=0)  # over every worker's rows
    if rank == 0:
        print(f"{strategy.num_replicas_in_sync} workers: test loss {loss:.4f}, accuracy {accuracy:.4f}")
    runtime.shutdown()
    return 0 if accuracy >= TARGET_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
