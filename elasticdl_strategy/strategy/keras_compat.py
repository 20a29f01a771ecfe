"""The one place that adapts Keras internals to AllReduceStrategy, version-checked.

Keras 3 gathers ``predict`` outputs across workers only for
MultiWorkerMirroredStrategy (``keras/src/backend/tensorflow/trainer.py``:
``reduce_per_replica(..., reduction="concat")``). For AllReduceStrategy each
worker would return just its own rows. :func:`install` wraps that function so
that, under an AllReduceStrategy of several workers, "concat" becomes an
all-gather along the batch axis: every worker's rows in rank order, which is
the input order because each global batch is split into contiguous shares.
Other reductions and other strategies are left to Keras.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Keras minor versions this adaptation is tested with.
SUPPORTED_KERAS_MINOR_VERSIONS = ("3.15",)

_installed = False


def install(strategy_class: type) -> bool:
    """Installs the predict adaptation once; returns whether it is active."""
    global _installed
    if _installed:
        return True
    import keras
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    minor = ".".join(keras.__version__.split(".")[:2])
    original = getattr(trainer, "reduce_per_replica", None)
    if minor not in SUPPORTED_KERAS_MINOR_VERSIONS or original is None:
        logger.warning(
            "Keras %s is not one elasticdl_strategy is tested with (%s): model.predict under "
            "AllReduceStrategy returns only this worker's rows",
            keras.__version__,
            ", ".join(SUPPORTED_KERAS_MINOR_VERSIONS),
        )
        return False

    def reduce_per_replica(values, strategy, reduction):
        if reduction == "concat" and isinstance(strategy, strategy_class) and strategy.num_replicas_in_sync > 1:
            return tree.map_structure(lambda value: strategy.gather(value, axis=0), values)
        return original(values, strategy, reduction)

    trainer.reduce_per_replica = reduce_per_replica
    _installed = True
    return True
