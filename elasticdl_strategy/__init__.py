"""elasticdl_strategy: elastic data-parallel training for TensorFlow 2 over a gRPC ring all-reduce.

Layers, bottom-up: :mod:`~elasticdl_strategy.transport` (gRPC, streaming, auth),
:mod:`~elasticdl_strategy.collective` (point-to-point and collectives),
:mod:`~elasticdl_strategy.coordinator` (rendezvous, membership, heartbeats),
:mod:`~elasticdl_strategy.strategy` (``AllReduceStrategy``, the tf.distribute integration),
:mod:`~elasticdl_strategy.elastic` and :mod:`~elasticdl_strategy.data` (commit/restore, exactly-once records),
:mod:`~elasticdl_strategy.launcher` (local processes).
"""

import logging

__version__ = "0.1.0"

# A library configures no logging for its users (see elasticdl_strategy.logs for the job's own processes).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["AllReduceStrategy", "__version__"]


def __getattr__(name):
    # Imported lazily: the collective API must not pay for importing TensorFlow.
    if name == "AllReduceStrategy":
        from elasticdl_strategy.strategy import AllReduceStrategy

        return AllReduceStrategy
    raise AttributeError(f"module 'elasticdl_strategy' has no attribute {name!r}")
