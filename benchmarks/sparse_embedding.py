"""Sparse against dense reduction of an embedding's gradients: bytes on the wire and time per step.

A 1,000,000 x 32 float32 embedding (122 MiB) under a Dense head, trained by a
custom loop (Adam) on N local workers; each global batch of 256 rows holds 8
ids per row drawn from a Zipf-like distribution, so ids repeat within a batch
as in real recommendation data. Two runs side by side in one invocation:

- ``sparse`` (default): the embedding's ``IndexedSlices`` are all-gathered,
  one row per occurrence: each worker sends its rows, so the bytes follow the
  rows the batch touched.
- ``dense`` (``AllReduceStrategy(sparse_as_dense=True)``): the embedding's
  gradient joins the dense fused all-reduce: 2(N-1)/N of the whole table.

Prints per mode the median step time over ``--repeats`` windows of
``--steps`` steps and the payload bytes each worker sent per step, then the
ratios. Usage::

    python benchmarks/sparse_embedding.py --workers 2 --repeats 5 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import checkout  # noqa: F401,E402  (first: the checkout's elasticdl_strategy, in this process and its children)

ROWS, WIDTH, BATCH, IDS_PER_ROW = 1_000_000, 32, 256, 8


def worker(mode: str, out: str, steps: int, repeats: int) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    from elasticdl_strategy import AllReduceStrategy, runtime

    strategy = AllReduceStrategy(sparse_as_dense=mode == "dense")
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.2, size=(BATCH * (steps + 2), IDS_PER_ROW)) - 1, ROWS - 1)
    targets = rng.standard_normal((len(ids), 1)).astype("float32")
    batches = iter(
        strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((ids, targets)).batch(BATCH).repeat()
        )
    )
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((IDS_PER_ROW,), dtype="int64"),
                keras.layers.Embedding(ROWS, WIDTH),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        optimizer = keras.optimizers.Adam(1e-3)

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(tf.reduce_mean((model(x) - y) ** 2, axis=-1), global_batch_size=BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(replica, args=(x, y)), axis=None)

    for _ in range(2):
        step(*next(batches))  # trace and warm up
    p2p = runtime.communicator().p2p
    windows, sent = [], []
    for _ in range(repeats):
        runtime.barrier()
        before, start = p2p.bytes_sent, time.perf_counter()
        for _ in range(steps):
            step(*next(batches))
        windows.append((time.perf_counter() - start) / steps)
        sent.append((p2p.bytes_sent - before) / steps)
    if runtime.rank() == 0:
        with open(out, "w") as f:
            json.dump({"step_s": statistics.median(windows), "bytes_per_step": statistics.median(sent)}, f)
    runtime.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.steps, args.repeats)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sparse", "dense"):
            out = os.path.join(tmp, f"{mode}.json")
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--steps",
                str(args.steps),
                "--repeats",
                str(args.repeats),
                "--worker",
                mode,
                out,
            ]
            subprocess.run(
                [sys.executable, "-m", "elasticdl_strategy", "run", "--workers", str(args.workers), "--", *command],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            with open(out) as f:
                results[mode] = json.load(f)
    print(
        f"embedding {ROWS} x {WIDTH} float32, batch {BATCH} x {IDS_PER_ROW} ids, N = {args.workers}, "
        f"medians of {args.repeats} windows of {args.steps} steps"
    )
    print(f"{'mode':<8}{'ms/step':>10}{'MiB sent/step':>16}")
    for mode, r in results.items():
        print(f"{mode:<8}{r['step_s'] * 1e3:>10.1f}{r['bytes_per_step'] / 2**20:>16.3f}")
    s, d = results["sparse"], results["dense"]
    print(
        f"sparse / dense: time {s['step_s'] / d['step_s']:.3f}x, bytes {s['bytes_per_step'] / d['bytes_per_step']:.5f}x"
    )


if __name__ == "__main__":
    main()
