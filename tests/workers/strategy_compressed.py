"""Worker of tests/strategy/test_compression_training.py: trains a float32 MLP with
``AllReduceStrategy(compression=...)`` by Keras fit.

Usage: strategy_compressed.py none|fp16|bf16 RESULTS_DIR

Writes ``{results_dir}/rank{r}.json`` with the final weights, the epoch losses
and the all-reduce bytes this rank sent.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime
from tests.workers.report import write_report

GLOBAL_BATCH = 48
ROWS = 480


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 8)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((8, 2))).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def main(compression: str, results_dir: str) -> None:
    strategy = AllReduceStrategy() if compression == "none" else AllReduceStrategy(compression=compression)
    keras.utils.set_random_seed(1234)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    before = runtime.stats()["bytes_sent"]
    history = model.fit(data(), epochs=3, verbose=0, shuffle=False)
    report = {
        "rank": runtime.rank(),
        "size": runtime.size(),
        "weights": [w.numpy().ravel().tolist() for w in model.weights],
        "losses": [float(x) for x in history.history["loss"]],
        "bytes_sent": runtime.stats()["bytes_sent"] - before,
    }
    write_report(results_dir, runtime.rank(), report)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
