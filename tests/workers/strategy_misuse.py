"""Worker of tests/strategy/test_api.py: ways to train outside the strategy, each must raise UsageError."""

import sys

import keras
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report


def model_outside_scope(strategy):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(tf.data.Dataset.from_tensors((tf.ones([4, 3]), tf.ones([4, 1]))), verbose=0)


def model_outside_scope_compiled_inside(strategy):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with strategy.scope():
        model.compile(optimizer="sgd", loss="mse")
    model.fit(tf.data.Dataset.from_tensors((tf.ones([4, 3]), tf.ones([4, 1]))), verbose=0)


def apply_gradients_outside_run(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(tf.ones([4, 3])) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    with strategy.scope():
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


def optimizer_outside_scope(strategy):
    optimizer = keras.optimizers.SGD(0.1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(tf.ones([4, 3])) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    strategy.run(step)


def main(results_dir: str) -> None:
    strategy = AllReduceStrategy()
    outcomes = {}
    cases = (
        model_outside_scope,
        model_outside_scope_compiled_inside,
        apply_gradients_outside_run,
        optimizer_outside_scope,
    )
    for case in cases:
        try:
            case(strategy)
            outcomes[case.__name__] = None
        except Exception as e:  # recorded: the test checks type and message
            outcomes[case.__name__] = f"{type(e).__name__}: {e}"
    write_report(results_dir, runtime.rank(), outcomes)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
