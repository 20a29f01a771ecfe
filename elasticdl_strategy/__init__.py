"""elasticdl_strategy: elastic data-parallel training for TensorFlow 2 over a gRPC ring all-reduce.

Layers, bottom-up; each imports only its own and lower ones (``tests/test_layers.py`` checks):

1. :mod:`~elasticdl_strategy.transport`: gRPC servers and channels, data sockets, shared memory, auth.
2. :mod:`~elasticdl_strategy.collective`: point-to-point and collectives on one membership, numpy-level.
3. :mod:`~elasticdl_strategy.coordinator`: rendezvous, membership versions, heartbeats, commits, shards.
4. :mod:`~elasticdl_strategy.runtime`: this process in the job (``init``, a communicator per membership).
5. :mod:`~elasticdl_strategy.strategy`: ``AllReduceStrategy``, the tf.distribute integration.
6. :mod:`~elasticdl_strategy.elastic` and :mod:`~elasticdl_strategy.data`: commit/restore, exactly-once input.
7. :mod:`~elasticdl_strategy.launcher`: local processes and Kubernetes (``launcher.k8s``); the ``cli``.

:mod:`~elasticdl_strategy.errors` and :mod:`~elasticdl_strategy.logs` serve every layer.
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
