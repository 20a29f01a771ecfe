"""The custom-loop training step the strategy test workers share (the shape of TensorFlow's tutorial)."""

import tensorflow as tf


def make_step(strategy, model, optimizer, global_batch: int):
    """``step(x, y)``: one synchronous step of mean-squared error on the global batch; returns the summed loss."""

    def step(x, y):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(x) - y) ** 2, axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y)), axis=None)

    return step
