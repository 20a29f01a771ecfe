"""elasticdl_strategy: elastic data-parallel training for TensorFlow 2 over a gRPC ring all-reduce.

Layers, bottom-up: :mod:`~elasticdl_strategy.transport` (gRPC, streaming, auth),
:mod:`~elasticdl_strategy.collective` (point-to-point and collectives),
:mod:`~elasticdl_strategy.coordinator` (rendezvous, membership, heartbeats),
:mod:`~elasticdl_strategy.launcher` (local processes).
"""

__version__ = "0.1.0"
