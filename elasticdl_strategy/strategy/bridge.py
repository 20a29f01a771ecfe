"""From TensorFlow tensors to the ring: fused all-reduce and all-gather.

Inside a ``tf.function`` the tensors cross into Python through one stateful
``tf.numpy_function`` per call (~0.3 ms; ``py_function`` costs ~5 ms); in
eager mode the ring is called directly. Tensors of one dtype are fused into a
single buffer, in list order, so a step's gradients take one all-reduce per
dtype rather than one per variable.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from elasticdl_strategy import collective
from elasticdl_strategy.errors import CommunicationError, ConfigError
from elasticdl_strategy.strategy.tf_compat import control_flow_util, ops


def allreduce_arrays(arrays: Sequence[np.ndarray], op: str, timeout: Optional[float] = None) -> List[np.ndarray]:
    """All-reduces ``arrays`` with one ring pass per dtype; returns new arrays in the same order.

    ``op`` "mean" of integer arrays is the sum floor-divided by the number of
    workers, as TensorFlow's strategies do (Keras asks for it on label batches).
    """
    groups: Dict[np.dtype, List[int]] = {}
    for i, array in enumerate(arrays):
        groups.setdefault(array.dtype, []).append(i)
    results: List[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
    communicator = collective.communicator()
    for members in groups.values():
        fused = np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in members])
        integer_mean = op == "mean" and fused.dtype.kind in "iu"
        communicator.allreduce(fused, op="sum" if integer_mean else op, out=fused, timeout=timeout)
        if integer_mean:
            fused //= communicator.size
        offset = 0
        for i in members:
            size = arrays[i].size
            results[i] = fused[offset : offset + size].reshape(arrays[i].shape)
            offset += size
    return results


def _briefly(function):
    """Raises communication errors without the stack of the ring: TensorFlow logs the stack of
    every exception raised in a ``numpy_function``, and a peer's failure needs no 30-frame trace."""

    def call(*args):
        try:
            return function(*args)
        except CommunicationError as error:
            raise error.with_traceback(None) from None

    return call


def _check_not_xla() -> None:
    if control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise ConfigError(
            "AllReduceStrategy cannot reduce inside an XLA-compiled function: the ring runs in Python, "
            "which XLA cannot call. Compile without XLA (model.compile(jit_compile=False), "
            "tf.function(jit_compile=False))."
        )


def all_reduce_tensors(tensors: Sequence[tf.Tensor], op: str, timeout: Optional[float] = None) -> List[tf.Tensor]:
    """All-reduces ``tensors`` (``op`` "sum" or "mean") across workers; works eagerly and in graphs."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(a) for a in allreduce_arrays([t.numpy() for t in tensors], op, timeout)]
    _check_not_xla()
    outputs = tf.numpy_function(
        _briefly(lambda *arrays: allreduce_arrays(arrays, op, timeout)),
        tensors,
        [t.dtype for t in tensors],
        stateful=True,
        name="elasticdl_allreduce",
    )
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    for output, tensor in zip(outputs, tensors, strict=True):
        output.set_shape(tensor.shape)
    return list(outputs)


def all_gather_tensor(tensor: tf.Tensor, axis: int, timeout: Optional[float] = None) -> tf.Tensor:
    """Concatenates every worker's ``tensor`` along ``axis`` (whose size may differ per worker)."""
    tensor = tf.convert_to_tensor(tensor)

    def gather(array: np.ndarray) -> np.ndarray:
        moved = np.moveaxis(np.asarray(array), axis, 0)
        return np.ascontiguousarray(np.moveaxis(collective.communicator().allgather(moved, timeout=timeout), 0, axis))

    if tf.executing_eagerly():
        return tf.convert_to_tensor(gather(tensor.numpy()))
    _check_not_xla()
    output = tf.numpy_function(_briefly(gather), [tensor], tensor.dtype, stateful=True, name="elasticdl_allgather")
    shape = tensor.shape.as_list()
    if shape:
        shape[axis] = None
    output.set_shape(shape if tensor.shape.rank is not None else None)
    return output


def all_reduce_indexed_slices(slices: tf.IndexedSlices, op: str, timeout: Optional[float] = None) -> tf.IndexedSlices:
    """Reduces a sparse gradient (e.g. of an embedding) by all-gathering its rows.

    Rows with the same index are summed locally first, so each worker sends
    every touched row once; the result lists every worker's rows in rank
    order (an index may repeat across workers: sparse updates add them up).
    """
    unique, positions = tf.unique(tf.cast(slices.indices, tf.int64))
    values = tf.math.unsorted_segment_sum(slices.values, positions, tf.shape(unique)[0])
    indices = all_gather_tensor(unique, axis=0, timeout=timeout)
    values = all_gather_tensor(values, axis=0, timeout=timeout)
    if op == "mean":
        values = values / tf.cast(collective.size(), values.dtype)
    return tf.IndexedSlices(values, indices, slices.dense_shape)
