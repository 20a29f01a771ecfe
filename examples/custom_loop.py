"""A custom training loop with AllReduceStrategy: tf.function + strategy.run + strategy.reduce.

The structure of TensorFlow's custom-training tutorial, on N workers::

    elasticdl-strategy run --workers 2 -- python examples/custom_loop.py

Each worker runs ``train_step`` on its share of every global batch; the
optimizer's gradient all-reduce goes over the ring, and ``strategy.reduce``
sums the per-replica losses (each already divided by the global batch size).
The data (4 Gaussian classes in 16 dimensions) is generated.
Target: test accuracy >= 0.95 (the script exits 1 below it).
"""

import sys

import keras
import tensorflow as tf

from elasticdl_strategy import AllReduceStrategy, runtime

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from keras_fit import TARGET_ACCURACY, build_model, make_data, parse_args  # noqa: E402  (same data, model, flags)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    strategy = AllReduceStrategy()
    rank = runtime.rank()
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.Adam(1e-2)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        test_accuracy = keras.metrics.SparseCategoricalAccuracy()

    train = tf.data.Dataset.from_tensor_slices(make_data(args.samples, seed=1))
    train = strategy.experimental_distribute_dataset(train.shuffle(args.samples, seed=0).batch(args.global_batch))
    test = tf.data.Dataset.from_tensor_slices(make_data(2048, seed=2)).batch(args.global_batch)
    test = strategy.experimental_distribute_dataset(test)

    def train_step(features, labels):
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=args.global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    def test_step(features, labels):
        test_accuracy.update_state(labels, model(features, training=False))

    @tf.function
    def distributed_train_step(features, labels):
        per_replica_losses = strategy.run(train_step, args=(features, labels))
        return strategy.reduce("SUM", per_replica_losses, axis=None)

    @tf.function
    def distributed_test_step(features, labels):
        strategy.run(test_step, args=(features, labels))

    for epoch in range(args.epochs):
        total, batches = 0.0, 0
        for features, labels in train:
            total += float(distributed_train_step(features, labels))
            batches += 1
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total / batches:.4f}", flush=True)

    for features, labels in test:
        distributed_test_step(features, labels)
    accuracy = float(test_accuracy.result())  # read outside strategy.run: over every worker's rows
    if rank == 0:
        print(f"{strategy.num_replicas_in_sync} workers: test accuracy {accuracy:.4f}")
    runtime.shutdown()
    return 0 if accuracy >= TARGET_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
