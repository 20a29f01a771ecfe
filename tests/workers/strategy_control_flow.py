"""Worker of tests/strategy/test_control_flow.py: Keras and TensorFlow code that puts collectives
inside TensorFlow control flow (conds, while loops, nested functions).

Usage: strategy_control_flow.py RESULTS_DIR SCENARIO [SCENARIO ...]

Scenarios: ``plain_fit`` (SGD, no control flow: the 1/replicas loss scale), ``spe2`` / ``spe4``
(``steps_per_execution``), ``accumulate``
(``gradient_accumulation_steps=2``), ``batchnorm_sync`` (``BatchNormalization(synchronized=True)``:
its moving statistics too), ``mixed_fit`` (``mixed_float16`` + ``fit``),
``loss_scale_loop`` (a ``LossScaleOptimizer`` custom loop in a ``tf.function`` whose
third batch overflows in the last worker's rows only), ``while_loop`` (a user
``tf.while_loop`` calling a ``tf.function`` step, beside a ``strategy.reduce`` of its own).

Run with the launcher (N workers) or alone (the single-process reference); writes
``{results_dir}/rank{r}.json``: per scenario, the final weights and what else it reports.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report

GLOBAL_BATCH = 48  # divisible by 2 and 3, and so is ROWS: equal shares on every worker
ROWS = 240


def arrays(dtype="float64"):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 8))
    y = np.tanh(x @ rng.standard_normal((8, 2)))
    return x.astype(dtype), y.astype(dtype)


def dataset(dtype="float64"):
    return tf.data.Dataset.from_tensor_slices(arrays(dtype)).batch(GLOBAL_BATCH)


def build(optimizer):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False, **COMPILE)
    return model


COMPILE = {}


def fit(strategy, optimizer, epochs=3, dtype="float64", **compile_kwargs):
    COMPILE.clear()
    COMPILE.update(compile_kwargs)
    with strategy.scope():
        model = build(optimizer())
    history = model.fit(dataset(dtype), epochs=epochs, verbose=0)
    return model, {"losses": [float(v) for v in history.history["loss"]]}


def plain_fit(strategy):
    return fit(strategy, lambda: keras.optimizers.SGD(0.1))


def spe2(strategy):
    return fit(strategy, lambda: keras.optimizers.SGD(0.1), steps_per_execution=2)


def spe4(strategy):
    return fit(strategy, lambda: keras.optimizers.Adam(0.01), steps_per_execution=4)


def accumulate(strategy):
    return fit(strategy, lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), epochs=4)


def batchnorm_sync(strategy):
    """BatchNormalization(synchronized=True): batch statistics over the global batch (a cond in training)."""
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16),
                keras.layers.BatchNormalization(synchronized=True),
                keras.layers.Activation("tanh"),
                keras.layers.Dense(2),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    history = model.fit(dataset(), epochs=3, verbose=0)
    return model, {"losses": [float(v) for v in history.history["loss"]]}


def mixed_fit(strategy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return fit(strategy, lambda: keras.optimizers.SGD(0.1), dtype="float32")
    finally:
        keras.mixed_precision.set_global_policy("float64")


def loss_scale_loop(strategy):
    """Batch 2's last row is huge: its float16 forward pass overflows, on the last worker only."""
    x, y = arrays("float32")
    x[2 * GLOBAL_BATCH + GLOBAL_BATCH - 1] = 1e5
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0**10)
            optimizer.build(model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float64")
    batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean((tf.cast(model(x), tf.float32) - y) ** 2, axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def step(x, y):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    scales = []
    for _ in range(2):
        for xb, yb in batches:
            step(xb, yb)
            scales.append(float(optimizer.dynamic_scale.numpy()))
    return model, {"scales": scales}


def while_loop(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
    batches = strategy.experimental_distribute_dataset(dataset().repeat())

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean((model(x) - y) ** 2, axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    def rows(x):
        return tf.cast(tf.shape(x)[0], tf.float64)

    @tf.function  # a train step of its own, called in the loop: a nested function call
    def step(x, y):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    @tf.function
    def train(iterator, steps):
        total, seen = tf.constant(0.0, tf.float64), tf.constant(0.0, tf.float64)
        for _ in tf.range(steps):  # autograph: a tf.while_loop
            x, y = next(iterator)
            total += step(x, y)
            # Independent of the step: may run before, beside or after its gradient all-reduce.
            seen += strategy.reduce("SUM", strategy.run(rows, args=(x,)), axis=None)
        return total, seen

    iterator = iter(batches)
    results = [train(iterator, tf.constant(5)) for _ in range(3)]
    return model, {"losses": [float(t) for t, _ in results], "rows": [float(r) for _, r in results]}


SCENARIOS = {
    f.__name__: f for f in (plain_fit, spe2, spe4, accumulate, batchnorm_sync, mixed_fit, loss_scale_loop, while_loop)
}


def main(results_dir, names):
    keras.config.set_floatx("float64")
    strategy = AllReduceStrategy()
    report = {"rank": runtime.rank(), "size": runtime.size()}
    for name in names:
        # A different seed on every rank: the variables must start from rank 0's values anyway.
        keras.utils.set_random_seed(1234 + runtime.rank())
        model, extra = SCENARIOS[name](strategy)
        report[name] = {"weights": [np.asarray(w.numpy(), np.float64).ravel().tolist() for w in model.weights], **extra}
    write_report(results_dir, runtime.rank(), report)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
