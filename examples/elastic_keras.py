"""Elastic Keras training: workers may die, leave or join; every sample is used once per epoch.

Run on 3 local workers, surviving the loss of one and replacing it::

    elasticdl-strategy run --workers 3 --min-workers 2 --max-restarts 1 -- \\
        python examples/elastic_keras.py --checkpoint-dir /tmp/elastic-ckpt

Kill a worker while it trains (``kill -9 PID``): the others re-form within
about a second, roll back to the last commit and carry on; the launcher starts
a replacement that joins at the next commit. Kill all of them and start the
command again: training resumes from the last checkpoint.

The model and data are those of ``keras_fit.py``. Records are handed out by
the coordinator (:class:`elasticdl_strategy.data.ElasticRecords`); the batch
per worker is fixed, so the global batch follows the number of workers, and a
reset callback keeps the learning rate proportional to it: every worker,
a newcomer too, calls it before training in each membership (the first one
included), before the state is synced from rank 0.
Target: test accuracy >= 0.95 and identical replicas at the end (the script
exits 1 otherwise).
"""

import argparse
import hashlib
import sys

import keras
import numpy as np
import tensorflow as tf
from keras_fit import TARGET_ACCURACY, build_model, make_data

from elasticdl_strategy import AllReduceStrategy, data, elastic, runtime


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-per-worker", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batches-per-commit", type=int, default=10)
    parser.add_argument("--checkpoint-dir", help="durable checkpoints (a shared directory on a cluster)")
    parser.add_argument("--commits-per-checkpoint", type=int, default=5)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    strategy = AllReduceStrategy()
    base_lr = 2.5e-3  # per worker: the learning rate follows the global batch
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(base_lr),  # the reset callback below sets it for the job's size
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    features, labels = (tf.constant(a) for a in make_data(args.samples, seed=1))
    records = data.ElasticRecords(num_records=args.samples, batch_size=args.batch_per_worker, seed=0)
    state = elastic.KerasState(
        model, records=records, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.commits_per_checkpoint
    )
    state.register_reset_callbacks([lambda: model.optimizer.learning_rate.assign(base_lr * runtime.size())])

    @elastic.run
    def train(state):
        dataset = records.dataset().map(lambda i: (tf.gather(features, i), tf.gather(labels, i)))
        model.fit(
            dataset,
            epochs=args.epochs,
            initial_epoch=records.epoch,
            verbose=2,
            callbacks=state.callbacks(batches_per_commit=args.batches_per_commit),
        )

    train(state)
    identical = replicas_identical(state)
    test = tf.data.Dataset.from_tensor_slices(make_data(2048, seed=2)).batch(256)
    loss, accuracy = model.evaluate(test, verbose=0)
    if runtime.rank() == 0:
        print(f"{runtime.size()} workers at the end: test loss {loss:.4f}, accuracy {accuracy:.4f}")
        print("replicas identical (weights and optimizer state)" if identical else "replicas DIFFER")
    return 0 if accuracy >= TARGET_ACCURACY and identical else 1


def replicas_identical(state: elastic.KerasState) -> bool:
    """Whether every worker holds bitwise the same weights and optimizer state (a digest each)."""
    digest = hashlib.sha256(b"".join(np.asarray(v.numpy()).tobytes() for v in state.variables())).digest()
    digests = runtime.allgather(np.frombuffer(digest, np.uint8)[None, :])
    return all(np.array_equal(d, digests[0]) for d in digests)


if __name__ == "__main__":
    sys.exit(main())
