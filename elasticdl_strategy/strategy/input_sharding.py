"""Which part of a dataset each worker reads: tf.data's auto-shard policies under ``AllReduceStrategy``.

Every worker builds the same dataset, batched with the *global* batch size B,
and ``strategy.experimental_distribute_dataset`` (which ``fit`` calls) cuts
this worker's input from it according to
``tf.data.Options().experimental_distribute.auto_shard_policy``, as
MultiWorkerMirroredStrategy does:

=======  ==============================================  =================================================
policy   what each of the N workers reads                one step's global batch
=======  ==============================================  =================================================
AUTO     FILE when the source reads at least N files,    (the default of ``tf.data.Options``)
         DATA otherwise
FILE     only its files (``i, i + N, ...``); each local  B records, B/N from each worker's files; every
         batch of B is split into N steps of B/N         record once per epoch; workers whose files hold
                                                         fewer records feed empty batches at the end
DATA     its rows of every global batch                  one process's batch, exactly (see below)
         (``np.array_split``: sizes differ by at most 1)
HINT     ``shard(SHARD_HINT, SHARD_HINT)`` becomes       as FILE
         ``shard(N, i)``; batches split as in FILE
OFF      everything; each batch split into N steps       the same B/N records on every worker
=======  ==============================================  =================================================

FILE, HINT and OFF are TensorFlow's own rewrite (``rebatch`` then
``auto_shard``), exactly as under MultiWorkerMirroredStrategy, so a
worker's ``map`` runs on its own files' records only. DATA is ours: each
worker keeps rows ``np.array_split(range(B), N)[i]`` of every global batch,
so the workers of step k together train on one process's batch k — the
"one process on the global batch" contract, tested against one process in
float64 — and, unlike TensorFlow's DATA (``[4, 4, 2]`` for B = 10, N = 3),
shares never differ by more than one row. Where the pipeline allows it
(a known number of records, and only maps between the source and the batch:
see :mod:`.rows_before_maps`) a worker chooses its rows before the maps and
runs them on 1/N of the records; otherwise, as TensorFlow's DATA does, every
worker runs the pipeline before the batch on every record.

Datasets that already hold this worker's batches are taken as they are:
those of :mod:`elasticdl_strategy.data`, numpy inputs to ``fit`` (sliced per
worker before the rows are gathered, ``keras_compat``), and anything derived
from a dataset passed to :func:`mark_per_worker`.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Iterator, Optional

import tensorflow as tf

from elasticdl_strategy.errors import UsageError
from elasticdl_strategy.strategy.rows_before_maps import rows_before_maps
from elasticdl_strategy.strategy.tf_compat import dataset_function_graphs, dataset_inputs, reader_file_names

Policy: Any = tf.data.experimental.AutoShardPolicy  # an enum.IntEnum; Any for the type checker

# Dataset ops that read records out of files: TensorFlow's FILE sharding splits their file lists.
_READER_OPS = frozenset(
    {
        "TFRecordDataset",
        "TFRecordDatasetV2",
        "TextLineDataset",
        "FixedLengthRecordDataset",
        "FixedLengthRecordDatasetV2",
        "CSVDataset",
        "CSVDatasetV2",
        "ExperimentalCSVDataset",
    }
)
_READER_CLASSES = (
    tf.data.TFRecordDataset,
    tf.data.TextLineDataset,
    tf.data.FixedLengthRecordDataset,
    tf.data.experimental.CsvDataset,
)

_per_worker: "weakref.WeakSet[tf.data.Dataset]" = weakref.WeakSet()


class Sharding(enum.Enum):
    """How a worker's input is cut from the dataset."""

    AS_IS = "as is"  # the dataset holds this worker's batches already
    ROWS = "rows"  # this worker's rows of every global batch (our DATA)
    TENSORFLOW = "tensorflow"  # TensorFlow's rebatch + auto-shard rewrite with ``policy``


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`plan` decided for one dataset, and why (for the log)."""

    sharding: Sharding
    policy: Any = None  # a Policy for Sharding.TENSORFLOW: FILE, HINT or OFF
    reason: str = ""


def mark_per_worker(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Declares that ``dataset`` (and every dataset derived from it) yields this worker's batches.

    ``AllReduceStrategy`` then distributes it as it is, whatever its options
    say. For sources that shard themselves, such as :mod:`elasticdl_strategy.data`.

    >>> d = mark_per_worker(tf.data.Dataset.range(4).batch(2))
    >>> plan(d.map(lambda x: x + 1), size=2).sharding
    <Sharding.AS_IS: 'as is'>
    """
    _per_worker.add(dataset)
    return dataset


def plan(dataset: tf.data.Dataset, size: int) -> Plan:
    """Decides how each of ``size`` workers reads ``dataset`` (see the module docstring).

    Raises:
        UsageError: the policy is FILE but the dataset does not read at least ``size`` files.

    >>> rows = tf.data.Dataset.range(10).batch(4)
    >>> plan(rows, size=2)
    Plan(sharding=<Sharding.ROWS: 'rows'>, policy=None, reason='AUTO: not a source of files, so DATA')
    """
    if size == 1:
        return Plan(Sharding.AS_IS, reason="one worker")
    if any(d in _per_worker for d in _lineage(dataset)):
        return Plan(Sharding.AS_IS, reason="the dataset holds this worker's batches")
    policy = dataset.options().experimental_distribute.auto_shard_policy
    files = count_files(dataset)
    if policy == Policy.AUTO:
        if files is not None and files >= size:
            return Plan(Sharding.TENSORFLOW, Policy.FILE, f"AUTO: {files} files for {size} workers, so FILE")
        why = "not a source of files" if files is None else f"{files} files for {size} workers"
        return Plan(Sharding.ROWS, reason=f"AUTO: {why}, so DATA")
    if policy == Policy.FILE:
        if files is None or files < size:
            found = "no file reader" if files is None else f"{files} files"
            raise UsageError(
                f"auto_shard_policy FILE needs a dataset that reads at least {size} files (one per worker) "
                f"but found {found}: set it to DATA (every worker reads everything and keeps its rows) or AUTO"
            )
        return Plan(Sharding.TENSORFLOW, Policy.FILE, f"FILE: {files} files for {size} workers")
    if policy == Policy.DATA:
        return Plan(Sharding.ROWS, reason="DATA")
    return Plan(Sharding.TENSORFLOW, policy, policy.name)


def with_policy(dataset: tf.data.Dataset, policy) -> tf.data.Dataset:
    """``dataset`` with its auto-shard policy set to ``policy`` (what TensorFlow's rewrite reads)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def rows_of_global_batches(dataset: tf.data.Dataset, rank: int, size: int) -> tf.data.Dataset:
    """This worker's rows of every global batch (DATA): chosen before the per-record maps where the
    pipeline allows it (:mod:`.rows_before_maps`), else taken from each batch."""
    rewritten = rows_before_maps(dataset, rank, size)
    return rewritten if rewritten is not None else split_global_batches(dataset, rank, size)


def split_global_batches(dataset: tf.data.Dataset, rank: int, size: int) -> tf.data.Dataset:
    """Each global batch's rows ``np.array_split(range(batch), size)[rank]``, in every component."""

    def rows(x):
        batch = tf.shape(x)[0]
        base, extra = batch // size, batch % size
        start = rank * base + tf.minimum(rank, extra)
        return x[start : start + base + tf.cast(rank < extra, batch.dtype)]

    return dataset.map(lambda *element: tf.nest.map_structure(rows, element if len(element) > 1 else element[0]))


def count_files(dataset: tf.data.Dataset) -> Optional[int]:
    """How many files the dataset's one file-reading source reads, or None when that is not known.

    None when no reader is found, when there are several file sources, or when
    the file list's length cannot be computed (a ``filter``ed or repeated list).
    A reader is recognized as TensorFlow's FILE sharding recognizes it: one of
    tf.data's file datasets, or an ``interleave``/``flat_map`` over file names
    whose function opens one.

    >>> count_files(tf.data.Dataset.range(3))  # no files at all
    """
    counts = [n for n in (_files_read_by(d) for d in _lineage(dataset)) if n is not None]
    if len(counts) != 1 or counts[0] < 0:  # tf.data.UNKNOWN_CARDINALITY and INFINITE are negative
        return None
    return counts[0]


def _files_read_by(dataset: tf.data.Dataset) -> Optional[int]:
    if isinstance(dataset, _READER_CLASSES):
        names = reader_file_names(dataset)
        return int(names.cardinality()) if isinstance(names, tf.data.Dataset) else int(tf.size(names))
    inputs = dataset_inputs(dataset)
    if len(inputs) == 1 and any(_opens_files(g) for g in dataset_function_graphs(dataset)):
        return int(inputs[0].cardinality())
    return None


def _opens_files(graph_def) -> bool:
    """Whether a tf.data function (an interleave's, a flat_map's) creates a file reader."""
    ops = {node.op for node in graph_def.node}
    ops.update(node.op for function in graph_def.library.function for node in function.node_def)
    return bool(ops & _READER_OPS)


def _lineage(dataset: tf.data.Dataset) -> Iterator[tf.data.Dataset]:
    """``dataset`` and every dataset it was made from (its inputs, their inputs, ...)."""
    stack, seen = [dataset], set()
    while stack:
        d = stack.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        yield d
        stack.extend(dataset_inputs(d))
