"""Layer 4: the tf.distribute integration (the only place that touches private TensorFlow modules)."""

from elasticdl_strategy.strategy.all_reduce_strategy import AllReduceStrategy

__all__ = ["AllReduceStrategy"]
