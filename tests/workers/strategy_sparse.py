"""Worker of tests/strategy/test_sparse.py: an embedding model trained with sparse or dense gradient reduction.

Usage: strategy_sparse.py sparse|dense RESULTS_DIR OPTIMIZER [OPTIMIZER ...]
(optimizers: sgd, adam, adagrad, rmsprop; a fresh model for each).

Run with the launcher, or alone for the reference: one process on the global
batch; alone with ``dense``, it applies its gradients densified, which is what
``sparse_as_dense=True`` hands the optimizer.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report

GLOBAL_BATCH = 16

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
}


def train(strategy, optimizer_name, densify):
    keras.utils.set_random_seed(7 + runtime.rank())
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30, size=(128, 3))  # repeated ids within and across workers' rows
    targets = rng.standard_normal((128, 1))
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((ids, targets)).batch(GLOBAL_BATCH)
    )
    with strategy.scope():
        embedding = keras.layers.Embedding(30, 4)
        dense = keras.layers.Dense(1)
        model = keras.Sequential([keras.Input((3,), dtype="int64"), embedding, keras.layers.Flatten(), dense])
        optimizer = OPTIMIZERS[optimizer_name]()
    kinds = {}

    @tf.function
    def step(x, y):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    tf.reduce_mean((model(x) - y) ** 2, axis=-1), global_batch_size=GLOBAL_BATCH
                )
            grads = tape.gradient(loss, model.trainable_variables)
            kinds["embedding_gradient"] = type(grads[0]).__name__
            if densify:
                grads = [tf.convert_to_tensor(g) for g in grads]
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y)), axis=None)

    step(*next(iter(dataset)))  # trace outside the count
    before = runtime.stats()["collectives"]
    losses = [float(step(x, y)) for _ in range(3) for x, y in dataset]
    kinds["collectives_per_step"] = (runtime.stats()["collectives"] - before) / len(losses)
    return {"weights": [w.numpy().ravel().tolist() for w in model.weights], "losses": losses, **kinds}


def main(reduction: str, results_dir: str, optimizers) -> None:
    keras.config.set_floatx("float64")
    strategy = AllReduceStrategy(sparse_as_dense=reduction == "dense")
    densify = reduction == "dense" and runtime.size() == 1
    report = {"rank": runtime.rank(), **{name: train(strategy, name, densify) for name in optimizers}}
    write_report(results_dir, runtime.rank(), report)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
