"""The device of a worker's replica: one GPU per worker process when TensorFlow sees one, else the CPU.

As with Horovod, every worker process is one replica on one GPU. A process
that sees one GPU (``elasticdl-strategy run --gpus-per-worker 1``, or a
Kubernetes pod with ``--gpu 1``) uses it. A process that sees several (no
``CUDA_VISIBLE_DEVICES`` isolation) uses the one at index
``EDL_LOCAL_RANK % len(gpus)``, so the workers of a host spread over its GPUs.
The variables and the compute of the replica go on that device; the ring
all-reduce works on host memory (``strategy/bridge.py``).
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Optional, Sequence

import tensorflow as tf

from elasticdl_strategy import environment
from elasticdl_strategy.strategy.tf_compat import device_util

logger = logging.getLogger(__name__)

CPU = "/device:CPU:0"


def gpu_index(count: int, local_rank: int) -> Optional[int]:
    """Which of ``count`` visible GPUs the worker in slot ``local_rank`` uses; ``None``: no GPU.

    >>> gpu_index(0, 1), gpu_index(1, 5), gpu_index(4, 6)
    (None, 0, 2)
    """
    return local_rank % count if count > 0 else None


def choose_device(gpus: Sequence[str], local_rank: int) -> str:
    """The replica's device: ``gpus[local_rank % len(gpus)]``, or the CPU when ``gpus`` is empty.

    Args:
        gpus: the logical GPU devices TensorFlow reports
            (``[d.name for d in tf.config.list_logical_devices("GPU")]``), in order.
        local_rank: the worker's slot on its host (``EDL_LOCAL_RANK``).

    >>> choose_device([], 1)
    '/device:CPU:0'
    >>> choose_device(["/device:GPU:0"], 1)
    '/device:GPU:0'
    >>> choose_device(["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"], 4)
    '/device:GPU:1'
    """
    index = gpu_index(len(gpus), local_rank)
    return CPU if index is None else gpus[index]


def replica_device(env: Mapping[str, str] = os.environ) -> str:
    """Chooses this worker's device (:func:`choose_device`) and returns its full name.

    When several GPUs are visible and TensorFlow is not initialized yet, the
    process is restricted to the chosen one first (``tf.config.set_visible_devices``,
    as Horovod's examples do): otherwise every worker would reserve memory on
    every GPU of the host. After that the chosen GPU is the only one TensorFlow
    lists. If TensorFlow was initialized before (ops ran before the strategy was
    created) it is too late; the GPU is still chosen, with a warning.

    Raises:
        ConfigError: ``EDL_LOCAL_RANK`` is not a non-negative integer.
    """
    local_rank = environment.local_rank(env)
    physical = tf.config.get_visible_devices("GPU")
    if len(physical) > 1:
        _restrict_to(physical, local_rank)
    logical = [device.name for device in tf.config.list_logical_devices("GPU")]
    device = device_util.resolve(choose_device(logical, local_rank))
    _log_once(device, local_rank, len(physical))
    return device


def _restrict_to(physical: Sequence, local_rank: int) -> None:
    index = gpu_index(len(physical), local_rank)
    assert index is not None
    try:
        tf.config.set_visible_devices([physical[index]], "GPU")
    except RuntimeError:  # TensorFlow is initialized: its devices are fixed
        logger.warning(
            "TensorFlow was initialized before AllReduceStrategy was created: this process holds memory on all %d "
            "visible GPUs but uses one; create the strategy before running ops, or give each worker its GPU "
            "(elasticdl-strategy run --gpus-per-worker 1)",
            len(physical),
        )


_logged: set = set()


def _log_once(device: str, local_rank: int, visible_gpus: int) -> None:
    if device not in _logged:
        _logged.add(device)
        logger.info(
            "replica device %s (%s=%d, %d GPU(s) visible to the process)",
            device,
            environment.LOCAL_RANK,
            local_rank,
            visible_gpus,
        )
