"""Worker of tests/strategy/test_buckets.py: float64 training with gradients reduced in several buckets.

Usage: strategy_buckets.py RESULTS_DIR [RUNS]

Trains the same 4-layer MLP three times with ``AllReduceStrategy(bucket_bytes=BUCKET_BYTES)``:
by ``model.fit``, by a custom loop in ``tf.function`` (one numpy_function per bucket) and by a
custom loop run eagerly (several buckets in one call); then, when the
communicator supports it, by the ``tf.function`` loop with ``compression="bf16"``. ``RUNS``
(comma-separated: fit, graph, eager, bf16) trains only those. Every ``Communicator.allreduce``
call is recorded (shape, dtype, compression) to show the order of the buckets, and every
``Communicator.allreduce_pieces`` call (a bucket read where it lies: compression "pieces").
Run with the launcher (N workers) or alone (the single-process reference); writes
``{results_dir}/rank{r}.json``.
"""

import inspect
import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from elasticdl_strategy.collective.communicator import Communicator
from elasticdl_strategy.strategy import bridge
from tests.workers.report import write_report
from tests.workers.train_step import make_step

GLOBAL_BATCH = 48
ROWS = 240
# Parameters (float64 bytes): dense 8x32 (2048) + 32 (256), dense_1 32x32 (8192) + 32, dense_2 32x16
# (4096) + 16 (128), dense_3 16x2 (256) + 2 (16, 64 with alignment). At 4096 bytes: four buckets.
BUCKET_BYTES = 4096
LAYERS = (32, 32, 16, 2)
COMPRESSION_SUPPORTED = "compression" in inspect.signature(Communicator.allreduce).parameters
CALLS = []  # (shape, dtype, compression) of every Communicator.allreduce while recording
RECORDING = [False]


def record_allreduce_calls() -> None:
    communicator = runtime.communicator()
    original, original_pieces = communicator.allreduce, communicator.allreduce_pieces

    def recording(array, *args, **kwargs):
        if RECORDING[0]:
            CALLS.append([list(np.shape(array)), np.asarray(array).dtype.name, kwargs.get("compression")])
        return original(array, *args, **kwargs)

    def recording_pieces(pieces, offsets, out, *args, **kwargs):
        if RECORDING[0]:
            CALLS.append([list(out.shape), out.dtype.name, "pieces"])
        return original_pieces(pieces, offsets, out, *args, **kwargs)

    communicator.allreduce, communicator.allreduce_pieces = recording, recording_pieces


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 8))
    y = np.tanh(x @ rng.standard_normal((8, 2)))
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def build():
    layers = [keras.layers.Dense(n, activation="tanh") for n in LAYERS[:-1]] + [keras.layers.Dense(LAYERS[-1])]
    return keras.Sequential([keras.Input((8,)), *layers])


def weights(model):
    return [w.numpy().ravel().tolist() for w in model.weights]


def train_fit(strategy):
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    history = model.fit(data(), epochs=2, verbose=0, shuffle=False)
    return {"weights": weights(model), "losses": history.history["loss"]}


def train_custom(strategy, eager: bool):
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.Adam(0.01)
    dataset = strategy.experimental_distribute_dataset(data())

    step = make_step(strategy, model, optimizer, GLOBAL_BATCH)

    if not eager:
        step = tf.function(step)
    batches = list(dataset)
    losses = [float(step(*batches[0]))]  # traces the function; the first Adam step builds the slots
    losses.append(float(step(*batches[1])))
    before = bridge.counters()
    del CALLS[:]
    RECORDING[0] = True
    losses.append(float(step(*batches[2])))  # one step, recorded
    RECORDING[0] = False
    calls = list(CALLS)
    middle = bridge.counters()
    for x, y in batches[3:] + batches:
        losses.append(float(step(x, y)))
    after = bridge.counters()
    return {
        "weights": weights(model),
        "losses": losses,
        "calls_per_step": calls,
        "buckets_per_step": middle["buckets"] - before["buckets"],
        "staging_allocations_after_warmup": after["staging_allocations"] - before["staging_allocations"],
        "steps_after_warmup": len(losses) - 2,
    }


def main(results_dir: str, runs: str = "fit,graph,eager,bf16") -> None:
    keras.config.set_floatx("float64")
    strategy = AllReduceStrategy(bucket_bytes=BUCKET_BYTES)
    # A different seed on every rank: the variables must start from rank 0's values anyway.
    keras.utils.set_random_seed(1234 + runtime.rank())
    record_allreduce_calls()
    report = {"rank": runtime.rank(), "size": runtime.size(), "compression_supported": COMPRESSION_SUPPORTED}
    trainings = {
        "fit": lambda: train_fit(strategy),
        "graph": lambda: train_custom(strategy, eager=False),
        "eager": lambda: train_custom(strategy, eager=True),
    }
    if COMPRESSION_SUPPORTED:
        trainings["bf16"] = lambda: train_custom(
            AllReduceStrategy(bucket_bytes=BUCKET_BYTES, compression="bf16"), eager=False
        )
    for run in runs.split(","):
        if run in trainings:
            report[run] = trainings[run]()
    write_report(results_dir, runtime.rank(), report)
    runtime.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
