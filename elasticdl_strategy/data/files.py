"""``ElasticFiles``: the records of TFRecord or text files a worker trains on, exactly once per epoch.

The records of the files, in file order, are numbered ``0 .. num_records-1``
and cut into shards exactly as :class:`~elasticdl_strategy.data.ElasticRecords`
cuts indices, with the same position (epoch, step, cursor) that commits
record and failures roll back. Each worker reads the runs of consecutive
records that the epoch's stream holds from its position on, each with
TensorFlow's reader and ``skip``/``take`` (``skip`` reads record headers
only), keeps the records of its shares (see :mod:`elasticdl_strategy.data.plan`)
and runs ``map_fn`` on those alone, then batches them per step.

Costs (``benchmarks/file_resume.py``, 2-core development machine, page
cache, medians of 7): skipping a record 12–26 µs (its header is read, its
payload sought over), reading a 100 KB record ~100 µs. So resuming at record
k of a file costs ~20 µs × k, once; and a worker reads, but does not parse,
the other workers' records of the shards it reads — against the milliseconds
it takes to decode and augment an image that is small, but on a network file
system it is N times the bytes per epoch. Shards default to the largest
file's record count, so most start at or near a file's beginning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from elasticdl_strategy import runtime
from elasticdl_strategy.data.plan import rank_share, step_bounds
from elasticdl_strategy.data.records import ElasticRecords
from elasticdl_strategy.errors import UsageError
from elasticdl_strategy.strategy.input_sharding import mark_per_worker

logger = logging.getLogger(__name__)

FORMATS = ("tfrecord", "text")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one iteration of :meth:`ElasticFiles.dataset` reads, from the position it starts at."""

    file_ids: np.ndarray  # the runs of the stream from the position, in order: file,
    offsets: np.ndarray  # first record in that file,
    counts: np.ndarray  # and how many records
    mine: np.ndarray  # per record of those runs: whether this worker trains on it
    sizes: np.ndarray  # this worker's share of each step (positive)
    empty_last: bool  # a last step with no record for this worker (fewer left than workers)


class ElasticFiles(ElasticRecords):
    """The records of ``files`` for this worker, each used once per epoch by the job.

    Args:
        files: TFRecord or text files, in a fixed order (the same on every worker).
        batch_size: records per worker per step; or ``global_batch_size``: records per
            step whatever the number of workers (see ``ElasticRecords``).
        format: ``"tfrecord"`` or ``"text"`` (one record per line: CSV, JSON lines, ...).
        compression_type: ``""``, ``"GZIP"`` or ``"ZLIB"``, as TensorFlow's readers take it.
        header_lines: lines to leave out at the top of every text file (a CSV header).
        record_counts: the records in each file, when known; otherwise each file is counted
            once (read through; header lines not counted) and, with ``counts_cache``, the counts are kept in that JSON
            file for the next run (keyed by path, size and modification time).
        counts_cache: where to keep counted record counts (a path the workers share, or not).
        shard_size: consecutive records per shard; by default the largest file's count,
            so that a shard is about one file (fewer mid-file starts to skip to).
        seed, shuffle: the shards' order, reshuffled every epoch.

    Every worker must pass the same files with the same counts: the coordinator refuses
    a worker whose list differs (``UsageError`` naming both).

    Example::

        files = data.ElasticFiles(sorted(glob.glob("/data/train-*.tfrecord")), batch_size=64,
                                  counts_cache="/ckpt/record-counts.json", seed=1)
        state = elastic.KerasState(model, records=files, checkpoint_dir="/ckpt")

        @elastic.run
        def train(state):
            model.fit(files.dataset(parse_and_augment), epochs=90, initial_epoch=files.epoch,
                      callbacks=state.callbacks(batches_per_commit=100))
    """

    def __init__(
        self,
        files: Sequence[str],
        batch_size: Optional[int] = None,
        *,
        global_batch_size: Optional[int] = None,
        format: str = "tfrecord",
        compression_type: str = "",
        header_lines: int = 0,
        record_counts: Optional[Sequence[int]] = None,
        counts_cache: Optional[str] = None,
        shard_size: Optional[int] = None,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if isinstance(files, str) or not files:
            raise UsageError("ElasticFiles needs a non-empty list of file names")
        if format not in FORMATS:
            raise UsageError(f"ElasticFiles(format={format!r}): expected one of {', '.join(FORMATS)}")
        if header_lines < 0 or (header_lines and format != "text"):
            raise UsageError(f"header_lines={header_lines}: a non-negative number, for text files only")
        self.files = [os.fspath(f) for f in files]
        self.format, self.compression_type, self.header_lines = format, compression_type, header_lines
        if record_counts is None:
            lines = count_records(self.files, self._reader, counts_cache)
            record_counts = [max(0, n - header_lines) for n in lines]
        if len(record_counts) != len(self.files) or any(c < 0 for c in record_counts):
            raise UsageError(f"record_counts: one non-negative count per file ({len(self.files)} files)")
        self.record_counts = [int(c) for c in record_counts]
        total = sum(self.record_counts)
        if total == 0:
            raise UsageError(f"the {len(self.files)} files hold no records")
        shard_size = shard_size or max(self.record_counts)
        super().__init__(total, batch_size, shard_size, seed, shuffle, global_batch_size=global_batch_size)
        self.spec = dataclasses.replace(self.spec, fingerprint=_fingerprint(self.files, self.record_counts))
        self._first_record = np.concatenate([[0], np.cumsum(self.record_counts)]).astype(np.int64)

    def dataset(
        self, map_fn: Optional[Callable] = None, num_parallel_calls: Optional[int] = tf.data.AUTOTUNE
    ) -> tf.data.Dataset:
        """Batches of this worker's records, one per step, from the current position to the end of its epoch.

        ``map_fn`` (e.g. parse and augment) runs on each of this worker's records, in order;
        the batches are of its outputs. Each iteration (``fit`` starts one per epoch) begins
        where the position is at that moment. Don't re-batch or shuffle the result.
        """
        names = tf.constant(self.files)
        reader = self._reader

        def read(file_id, offset, count):
            return reader(tf.gather(names, file_id)).skip(offset).take(count)

        def records_of(plan):
            file_ids, offsets, counts, mine, sizes, empty_last = plan
            runs = tf.data.Dataset.from_tensor_slices((file_ids, offsets, counts)).flat_map(read)
            kept = runs.enumerate().filter(lambda i, _: tf.gather(mine, i)).map(lambda _, record: record)
            if map_fn is not None:
                kept = kept.map(map_fn, num_parallel_calls=num_parallel_calls, deterministic=True)
            batches = kept.batch(1).rebatch(sizes)
            empty = tf.data.Dataset.from_tensors(tf.nest.map_structure(_empty_batch, kept.element_spec))
            return batches.concatenate(empty.take(tf.cast(empty_last, tf.int64)))

        signature = (
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.bool),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([], tf.bool),
        )
        plans = tf.data.Dataset.from_generator(self._plans, output_signature=signature)
        return mark_per_worker(plans.flat_map(lambda *plan: records_of(plan)).prefetch(tf.data.AUTOTUNE))

    def _plans(self):
        plan = self.plan()
        yield (plan.file_ids, plan.offsets, plan.counts, plan.mine, plan.sizes, plan.empty_last)

    def plan(self, rank: Optional[int] = None, size: Optional[int] = None) -> _Plan:
        """What this worker (``rank`` of ``size``, by default the current ones) reads from the position."""
        rank = runtime.rank() if rank is None else rank
        size = runtime.size() if size is None else size
        cursor = self.position.cursor
        steps = list(step_bounds(cursor, self.num_records, size, self.policy))
        mine = np.zeros(self.num_records - cursor, bool)
        sizes = []
        for start, end in steps:
            lo, hi = rank_share(start, end, rank, size)
            mine[lo - cursor : hi - cursor] = True
            sizes.append(hi - lo)
        empty_last = bool(sizes) and sizes[-1] == 0
        file_ids, offsets, counts = self._file_runs(self._stream(self.position.epoch).runs(cursor, self.num_records))
        return _Plan(file_ids, offsets, counts, mine, np.array([s for s in sizes if s > 0], np.int64), empty_last)

    def _file_runs(self, runs: List[Tuple[int, int]]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Runs of record indices cut at file boundaries: ``(file, first record in it, count)`` each."""
        pieces = []
        for first, count in runs:
            while count > 0:
                file_id = int(np.searchsorted(self._first_record, first, side="right")) - 1
                offset = first - int(self._first_record[file_id])
                take = min(count, self.record_counts[file_id] - offset)
                pieces.append((file_id, offset + self.header_lines, take))
                first, count = first + take, count - take
        columns = np.array(pieces, np.int64).reshape(-1, 3)
        return columns[:, 0], columns[:, 1], columns[:, 2]

    def _reader(self, name) -> tf.data.Dataset:
        if self.format == "text":
            return tf.data.TextLineDataset(name, compression_type=self.compression_type)
        return tf.data.TFRecordDataset(name, compression_type=self.compression_type)


def count_records(files: Sequence[str], reader: Callable[[str], tf.data.Dataset], cache: Optional[str]) -> List[int]:
    """Records per file, read from ``cache`` where path, size and modification time still match,
    else counted by reading the file through (and written back to ``cache``)."""
    known = _read_cache(cache)
    counts = []
    for name in files:
        try:
            status = os.stat(name)
        except OSError as e:
            raise UsageError(f"cannot read {name}: {e.strerror}") from None
        key = f"{os.path.abspath(name)}:{status.st_size}:{status.st_mtime_ns}"
        if key not in known:
            known[key] = int(reader(name).reduce(np.int64(0), lambda n, _: n + 1))
        counts.append(known[key])
    if cache is not None:
        _write_cache(cache, known)
    return counts


def _read_cache(cache: Optional[str]) -> dict:
    if cache is None or not os.path.exists(cache):
        return {}
    try:
        with open(cache) as f:
            return {str(k): int(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError) as e:
        logger.warning("ignoring the record-count cache %s (%s): counting again", cache, e)
        return {}


def _write_cache(cache: str, counts: dict) -> None:
    """Writes atomically: workers that count at once each replace the file with a complete one."""
    temporary = f"{cache}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(counts, f)
    os.replace(temporary, cache)


def _fingerprint(files: Sequence[str], counts: Sequence[int]) -> str:
    digest = hashlib.sha256(json.dumps([[os.path.basename(f), c] for f, c in zip(files, counts)]).encode())
    return f"{len(files)} files: {digest.hexdigest()[:16]}"


def _empty_batch(spec: tf.TensorSpec) -> tf.Tensor:
    """A batch of no records, for a step in which this worker has none."""
    return tf.zeros([0] + [d if d is not None else 0 for d in spec.shape.as_list()], spec.dtype)
