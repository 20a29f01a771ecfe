"""DATA sharding that chooses a worker's rows *before* the per-record maps run.

Under the DATA policy each worker keeps its ``np.array_split`` share of every
global batch. Done after the batch (TensorFlow's DATA, and
:func:`input_sharding.split_global_batches`), every worker runs the pipeline's
per-record work — ``from_tensor_slices((x, y)).map(augment).batch(B)`` — on
every record, N times the work of the job. When the pipeline allows it, this
rewrite moves the choice below the maps::

    base -> map(f) -> map(g) -> batch(B) -> after
    base -> enumerate -> filter(this worker's positions) -> map(f) -> map(g) -> batch(share) -> after

The positions a worker keeps in each batch are those the row split takes, so
the batches are the same (the last one too: its shares are computed from its
length), only made from 1/N of the records. It applies when:

- the last batching op is ``batch`` with a constant size and ``drop_remainder``;
- between the record source (or the last shuffle, filter, interleave, ...) and
  that batch there are only ``map`` (parallel or not) and ``prefetch`` — these
  preserve order and count, so a record's position at the batch is its
  position at the source — and at least one ``map``;
- the number of records before the batch is known (``cardinality()``), so the
  last batch's length is;
- after the batch there are only ``map``, ``prefetch``, ``repeat``, ``take``,
  ``skip`` and options;
- no worker's share of a batch is empty.

Otherwise :func:`rows_before_maps` returns ``None`` and the rows are taken
from each batch as it comes. The maps are not traced again: their traced
functions are called on the new input.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import tensorflow as tf

from elasticdl_strategy.strategy.tf_compat import (
    batch_op,
    data_structure,
    dataset_ops,
    map_op,
    prefetch_op,
    repeat_op,
    skip_op,
    take_op,
    tensor_util,
)

_MAPS = (map_op._MapDataset, map_op._ParallelMapDataset)
_BATCHES = (batch_op._BatchDataset, batch_op._ParallelBatchDataset)
_PER_RECORD = _MAPS + (prefetch_op._PrefetchDataset, dataset_ops._OptionsDataset)
_AFTER_BATCH = _PER_RECORD + (repeat_op._RepeatDataset, take_op._TakeDataset, skip_op._SkipDataset)


def rows_before_maps(dataset: tf.data.Dataset, rank: int, size: int) -> Optional[tf.data.Dataset]:
    """``dataset``'s batches as this worker's rows, chosen before its per-record maps; or None.

    >>> counted = tf.data.Dataset.range(10).map(lambda x: x * 10).batch(4)
    >>> [b.numpy().tolist() for b in rows_before_maps(counted, rank=1, size=2)]
    [[20, 30], [60, 70], [90]]
    """
    after, node = _chain(dataset, _AFTER_BATCH, _BATCHES)
    if not isinstance(node, _BATCHES):
        return None
    batch, drop = _constant(node._batch_size), tensor_util.constant_value(node._drop_remainder)
    per_record, base = _chain(node._input_dataset, _PER_RECORD, ())
    if batch is None or drop is None or not any(isinstance(op, _MAPS) for op in per_record):
        return None
    records = int(base.cardinality())
    if records < 0:  # unknown or infinite
        return None
    full, last = divmod(records, batch)
    if batch < size or (last and not drop and last < size):
        return None  # a worker with an empty share: the row split gives it an empty batch, this could not
    lo, hi = _share(batch, rank, size)
    last_lo, last_hi = _share(last, rank, size) if last and not drop else (0, 0)

    def mine(position):
        within = position % batch
        in_full = position < full * batch
        return tf.where(in_full, (lo <= within) & (within < hi), (last_lo <= within) & (within < last_hi))

    rows = base.enumerate().filter(lambda i, _: mine(i)).map(lambda _, record: record)
    for op in reversed(per_record):
        rows = _replay(op, rows)
    rows = rows.batch(hi - lo, drop_remainder=bool(drop))
    for op in reversed(after):
        rows = _replay(op, rows)
    return rows.with_options(dataset.options())


def _chain(dataset: tf.data.Dataset, passes, stop) -> Tuple[List[tf.data.Dataset], tf.data.Dataset]:
    """The ops of ``passes`` kinds from ``dataset`` down (outermost first), and the first other node."""
    ops = []
    while isinstance(dataset, passes) and not isinstance(dataset, stop):
        ops.append(dataset)
        dataset = dataset._input_dataset
    return ops, dataset


def _constant(tensor) -> Optional[int]:
    value = tensor_util.constant_value(tensor)
    return None if value is None else int(value)


def _share(length: int, rank: int, size: int) -> Tuple[int, int]:
    """Rows ``[lo, hi)`` of a batch of ``length`` that ``rank`` takes (``np.array_split``)."""
    base, extra = divmod(length, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def _replay(op: tf.data.Dataset, dataset: tf.data.Dataset) -> tf.data.Dataset:
    """``op`` applied again, to ``dataset`` (options are put back once, at the end)."""
    if isinstance(op, map_op._ParallelMapDataset):
        deterministic = {"true": True, "false": False}.get(op._deterministic)
        return dataset.map(_traced(op), num_parallel_calls=op._num_parallel_calls, deterministic=deterministic)
    if isinstance(op, map_op._MapDataset):
        return dataset.map(_traced(op))
    if isinstance(op, prefetch_op._PrefetchDataset):
        return dataset.prefetch(int(op._buffer_size))
    if isinstance(op, repeat_op._RepeatDataset):
        return dataset.repeat(op._count)
    if isinstance(op, take_op._TakeDataset):
        return dataset.take(op._count)
    if isinstance(op, skip_op._SkipDataset):
        return dataset.skip(op._count)
    return dataset  # options


def _traced(op) -> Callable:
    """A map's function as traced for the original pipeline, callable on the new one's elements."""
    wrapper = op._map_func
    function, inputs, outputs = wrapper.function, wrapper._input_structure, wrapper._output_structure

    def call(*args):
        element = args[0] if len(args) == 1 else args
        results = function(*data_structure.to_tensor_list(inputs, element))
        return data_structure.from_compatible_tensor_list(outputs, results)

    return call
