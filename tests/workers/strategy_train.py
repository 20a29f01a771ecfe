"""Worker of tests/strategy: trains float64 MLPs with AllReduceStrategy, by Keras fit or a custom loop.

Usage: strategy_train.py CASE[,CASE...] RESULTS_DIR, each CASE ``MODE-OPTIMIZER`` with MODE
fit|custom|xla and OPTIMIZER sgd|adam: one fresh model per case, one after the other in one
process (the cases share the process's start-up, TensorFlow's import the largest part).

Run with the launcher (N workers) or alone (the single-process reference);
writes ``{results_dir}/rank{r}.json``: per case, the final weights and the losses.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report
from tests.workers.train_step import make_step

# Divisible by 2 and 3, and so is the number of rows: every worker gets equal shares.
GLOBAL_BATCH = 48
ROWS = 240
STATS = {}
OPTIMIZER = "sgd"


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 8))
    y = np.tanh(x @ rng.standard_normal((8, 2)))
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def build():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.01) if OPTIMIZER == "adam" else keras.optimizers.SGD(0.1)
    return model, optimizer


def train_fit(strategy):
    with strategy.scope():
        model, optimizer = build()
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    batch_losses = []
    recorder = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batch_losses.append(logs["loss"]))
    history = model.fit(data(), epochs=2, verbose=0, shuffle=False, callbacks=[recorder])
    STATS["batch_losses"] = [float(x) for x in batch_losses]
    # 50 rows in batches of 16: the last batch (2 rows) splits unevenly for N = 3.
    inputs = np.random.default_rng(5).standard_normal((50, 8))
    STATS["predictions"] = model.predict(inputs, batch_size=16, verbose=0).tolist()
    return model, history.history["loss"] + [model.evaluate(data(), verbose=0)]


def train_custom(strategy):
    with strategy.scope():
        model, optimizer = build()
    dataset = strategy.experimental_distribute_dataset(data())

    step = tf.function(make_step(strategy, model, optimizer, GLOBAL_BATCH))

    step(*next(iter(dataset)))  # trace outside the count (and take one step)
    before = runtime.stats()["collectives"]
    losses = [float(step(x, y)) for _ in range(2) for x, y in dataset]
    STATS["collectives_per_step"] = (runtime.stats()["collectives"] - before) / len(losses)
    return model, losses


def train_xla(strategy):
    """jit_compile=True cannot call the ring: must fail at trace time with a clear error."""
    with strategy.scope():
        model, optimizer = build()
        model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    try:
        model.fit(data(), epochs=1, verbose=0)
    except Exception as e:  # Keras may wrap the error; the message is what users see
        return model, [str(e)]
    return model, []


def run_case(strategy: AllReduceStrategy, case: str) -> dict:
    global OPTIMIZER
    mode, OPTIMIZER = case.split("-")
    STATS.clear()
    # A different seed on every rank: the variables must start from rank 0's values anyway.
    keras.utils.set_random_seed(1234 + runtime.rank())
    model, losses = {"fit": train_fit, "custom": train_custom, "xla": train_xla}[mode](strategy)
    context_ids = strategy.run(lambda: tf.distribute.get_replica_context().replica_id_in_sync_group)
    return {
        "rank": runtime.rank(),
        "size": runtime.size(),
        "replicas": strategy.num_replicas_in_sync,
        "replica_id": int(context_ids),
        "weights": [w.numpy().ravel().tolist() for w in model.weights],
        "losses": losses,
        **STATS,
    }


def main(cases: str, results_dir: str) -> None:
    keras.config.set_floatx("float64")
    strategy = AllReduceStrategy()
    write_report(results_dir, runtime.rank(), {case: run_case(strategy, case) for case in cases.split(",")})
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
