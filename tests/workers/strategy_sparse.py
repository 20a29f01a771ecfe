"""Worker of tests/strategy/test_sparse.py: an embedding model trained with sparse or dense gradient reduction."""

import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, collective
from tests.workers.report import write_report

GLOBAL_BATCH = 16


def main(sparse_as_dense: str, results_dir: str) -> None:
    keras.config.set_floatx("float64")
    strategy = AllReduceStrategy(sparse_as_dense=sparse_as_dense == "dense")
    keras.utils.set_random_seed(7 + collective.rank())
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
        optimizer = keras.optimizers.SGD(0.5)
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
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y)), axis=None)

    step(*next(iter(dataset)))  # trace outside the count
    before = collective.communicator().p2p.messages_sent
    losses = [float(step(x, y)) for _ in range(3) for x, y in dataset]
    kinds["messages_per_step"] = (collective.communicator().p2p.messages_sent - before) / len(losses)
    report = {
        "rank": collective.rank(),
        "weights": [w.numpy().ravel().tolist() for w in model.weights],
        "losses": losses,
        **kinds,
    }
    write_report(results_dir, collective.rank(), report)
    collective.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
