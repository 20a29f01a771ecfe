"""``ElasticRecords``: the record indices a worker trains on, exactly once per epoch."""

from __future__ import annotations

from typing import Dict, Iterator, Optional

import numpy as np
import tensorflow as tf

from elasticdl_strategy import runtime
from elasticdl_strategy.coordinator.position import Position
from elasticdl_strategy.coordinator.shards import DatasetSpec
from elasticdl_strategy.data.plan import BatchPolicy, EpochStream, next_cursor, rank_share, step_bounds
from elasticdl_strategy.strategy.input_sharding import mark_per_worker
from elasticdl_strategy.transport.protos import coordinator_pb2

_WITHOUT_AUTOTUNE = tf.data.Options()
_WITHOUT_AUTOTUNE.autotune.enabled = False


class ElasticRecords:
    """Record indices ``0 .. num_records-1`` for this worker, each used once per epoch by the job.

    The coordinator cuts the records into shards (index ranges of
    ``shard_size``) and hands out their order, reshuffled every epoch with
    ``seed``. Every step the job takes the next ``workers * batch_size``
    records of that order and each worker its share (see
    :mod:`elasticdl_strategy.data.plan`), so the position in the data is one
    cursor that all workers agree on. Put the records in an
    :class:`elasticdl_strategy.elastic` state: commits record the position,
    a failure rolls it back with the model, and records consumed after the last
    commit (a dead worker's too) are taken again by the survivors.

    Global batch policy, one of:

    - ``batch_size`` (per worker): the global batch is ``workers * batch_size``
      and changes with the number of workers (as in Horovod, ElasticDL and
      torchrun). Rescale the learning rate in a reset callback if it should
      follow the global batch (see ``elastic.State.register_reset_callbacks``).
    - ``global_batch_size``: every step takes that many records whatever the
      number of workers, each worker its share (sizes differing by at most
      one). A job that loses and gains workers then trains the very steps,
      on the very records, of a job that does not: the same model, up to the
      order of floating-point additions, and no learning rate to rescale.
      Losses must be averaged over the global batch for that to hold exactly
      when shares differ (``tf.nn.compute_average_loss(..., global_batch_size=G)``
      in a custom loop); Keras' ``fit`` averages each worker's loss first, so
      there it is exact when ``G`` divides by the number of workers.

    Example::

        records = ElasticRecords(num_records=len(x), batch_size=32, seed=7)
        state = elastic.KerasState(model, records=records)

        @elastic.run
        def train(state):
            dataset = records.dataset().map(lambda i: (tf.gather(x, i), tf.gather(y, i)))
            model.fit(dataset, epochs=5, initial_epoch=records.epoch, callbacks=state.callbacks())

    ``dataset()`` yields one batch of indices per step, starting at the
    current position; map it to features, don't re-batch or shuffle it.
    Tell the records that a step used its batch with :meth:`advance` (the
    callbacks of ``KerasState`` do it for ``fit``).
    """

    def __init__(
        self,
        num_records: int,
        batch_size: Optional[int] = None,
        shard_size: Optional[int] = None,
        seed: int = 0,
        shuffle: bool = True,
        *,
        global_batch_size: Optional[int] = None,
    ):
        self.policy = BatchPolicy(per_worker=batch_size, global_batch=global_batch_size)
        if shard_size is None:
            shard_size = max(1, min(num_records, 4 * (batch_size or global_batch_size or 1)))
        self.spec = DatasetSpec(num_records, shard_size, seed, shuffle)
        self.position = Position()
        self._streams: Dict[int, EpochStream] = {}
        self._dataset: Optional[tf.data.Dataset] = None  # made by the first dataset(), see there

    # ---- position ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def batch(self) -> int:
        return self.position.batch

    @property
    def num_records(self) -> int:
        return self.spec.num_records

    def advance(self) -> None:
        """Records that the step at the current position was taken (its records are in the model)."""
        p = self.position
        cursor = next_cursor(p.cursor, self.num_records, runtime.size(), self.policy)
        if cursor >= self.num_records:
            self.position = Position(p.epoch + 1, 0, 0)
        else:
            self.position = Position(p.epoch, p.batch + 1, cursor)

    def steps_left_in_epoch(self) -> int:
        """Steps from the current position to the end of its epoch, with the current workers."""
        return sum(1 for _ in step_bounds(self.position.cursor, self.num_records, runtime.size(), self.policy))

    # ---- indices ----------------------------------------------------------------------------

    def _stream(self, epoch: int) -> EpochStream:
        if epoch not in self._streams:
            worker = runtime.current_worker()
            if worker.client is None:
                starts, ends = self.spec.shards(epoch)
            else:
                s = self.spec
                proto = coordinator_pb2.DatasetSpec(
                    num_records=s.num_records,
                    shard_size=s.shard_size,
                    seed=s.seed,
                    shuffle=s.shuffle,
                    fingerprint=s.fingerprint,
                )
                starts, ends = worker.client.get_shards(proto, epoch)
            self._streams = {e: v for e, v in self._streams.items() if e >= epoch - 1}
            self._streams[epoch] = EpochStream(starts, ends)
        return self._streams[epoch]

    def batches(self) -> Iterator[np.ndarray]:
        """This worker's index batches from the current position to the end of its epoch."""
        p = self.position
        stream = self._stream(p.epoch)
        rank, size = runtime.rank(), runtime.size()
        for start, end in step_bounds(p.cursor, self.num_records, size, self.policy):
            yield stream.indices(*rank_share(start, end, rank, size))

    def dataset(self) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of int64 index vectors, one per step, from the current position.

        Each iteration (``fit`` starts one per epoch) begins where the
        position is at that moment and ends with its epoch. The batches are
        this worker's already: ``AllReduceStrategy`` distributes the dataset,
        and what is made from it, as it is (see ``input_sharding.mark_per_worker``).

        tf.data's autotuning is off in it (and what is made from it, unless
        their options turn it on again): there is nothing to tune in a
        generator of index vectors, and an iterator with autotuning, deleted
        when a failure ends the training loop, waited for its tuning thread's
        next period (up to 10 s into a job) before the worker could recover
        (``benchmarks/recovery.py``: 10 of 46 recoveries took ~10 s, none of 32 after).

        Made once (outside ``tf.function``) and returned again: each iteration
        reads the position and the membership when it starts, so the same object
        serves every epoch and every membership, and a training function called
        again after a re-formation does not pay for building it (~12 ms, ~25 on a
        slower machine).
        """
        if not tf.executing_eagerly():  # traced into a graph: that graph's own
            return self._make_dataset()
        if self._dataset is None:
            self._dataset = self._make_dataset()
        return self._dataset

    def _make_dataset(self) -> tf.data.Dataset:
        dataset = tf.data.Dataset.from_generator(
            self.batches, output_signature=tf.TensorSpec(shape=[None], dtype=tf.int64)
        )
        return mark_per_worker(dataset.with_options(_WITHOUT_AUTOTUNE))
