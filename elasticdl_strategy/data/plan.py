"""Which records each step and each rank take: a pure function of the data position.

The records of an epoch form one stream: the epoch's shards (index ranges,
in the order the coordinator hands out) one after the other. A position is a
*cursor* into that stream. From a cursor every step takes the next run of
records — ``workers × batch_size`` of them, or a fixed ``global_batch`` (see
:class:`BatchPolicy`) — and rank ``r`` takes the ``r``-th contiguous share of
them (split like ``np.array_split``). So each step consumes a contiguous run
of the stream, the records consumed so far are always exactly the first
``cursor`` ones, and a position is one number that every rank agrees on.

The last step of an epoch takes what is left. With a batch per worker, when
that would leave fewer records than workers for a final step, they are folded
into the step before (some workers then take ``batch_size + 1``), so that no
worker gets an empty batch unless the epoch has fewer records left than
there are workers. With a fixed global batch nothing is folded: every step
but the last is ``global_batch`` records whatever the number of workers.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from elasticdl_strategy.errors import UsageError


@dataclasses.dataclass(frozen=True)
class BatchPolicy:
    """How many records one step of the job takes.

    ``per_worker``: ``workers × per_worker`` (the global batch follows the number
    of workers, as in Horovod, ElasticDL and torchrun). ``global_batch``: that
    many whatever the number of workers, each taking its share (``global_batch /
    workers``, the shares differing by at most one), so that a job that loses and
    gains workers trains the same steps on the same records as one that does not.

    >>> BatchPolicy(per_worker=4).step_records(workers=3), BatchPolicy(global_batch=12).step_records(workers=3)
    (12, 12)
    >>> BatchPolicy(per_worker=4).step_records(workers=2), BatchPolicy(global_batch=12).step_records(workers=2)
    (8, 12)
    """

    per_worker: Optional[int] = None
    global_batch: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.per_worker is None) == (self.global_batch is None):
            raise UsageError("give either a batch size per worker or a global batch size, not both or neither")
        for name in ("per_worker", "global_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{'batch_size' if name == 'per_worker' else 'global_batch_size'}={value!r} "
                                  "must be a positive integer")  # fmt: skip

    def step_records(self, workers: int) -> int:
        return self.global_batch if self.global_batch is not None else workers * self.per_worker  # type: ignore[operator]

    @property
    def folds_the_rest(self) -> bool:
        """Whether a final step of fewer records than workers is folded into the step before."""
        return self.per_worker is not None


def step_bounds(cursor: int, num_records: int, workers: int, policy: BatchPolicy) -> Iterator[Tuple[int, int]]:
    """Yields ``(start, end)`` stream positions of the steps from ``cursor`` to the end of the epoch.

    >>> list(step_bounds(0, 10, workers=2, policy=BatchPolicy(per_worker=2)))
    [(0, 4), (4, 8), (8, 10)]
    >>> list(step_bounds(0, 9, workers=2, policy=BatchPolicy(per_worker=2)))  # the 1 left is folded in
    [(0, 4), (4, 9)]
    >>> list(step_bounds(0, 9, workers=2, policy=BatchPolicy(global_batch=4)))  # nothing folded
    [(0, 4), (4, 8), (8, 9)]
    """
    step = policy.step_records(workers)
    while cursor < num_records:
        end = min(cursor + step, num_records)
        if policy.folds_the_rest and 0 < num_records - end < workers:
            end = num_records
        yield cursor, end
        cursor = end


def next_cursor(cursor: int, num_records: int, workers: int, policy: BatchPolicy) -> int:
    """The cursor after one step taken at ``cursor``."""
    return next(step_bounds(cursor, num_records, workers, policy), (cursor, cursor))[1]


def rank_share(start: int, end: int, rank: int, workers: int) -> Tuple[int, int]:
    """The part ``[lo, hi)`` of the step ``[start, end)`` that ``rank`` takes."""
    take = end - start
    return start + take * rank // workers, start + take * (rank + 1) // workers


class EpochStream:
    """The records of one epoch in consumption order: shards ``[starts[i], ends[i])`` back to back.

    Example: shard ``[10, 15)`` first, then ``[0, 5)``.

    >>> stream = EpochStream([10, 0], [15, 5])
    >>> stream.indices(3, 7).tolist()
    [13, 14, 0, 1]
    """

    def __init__(self, starts: Union[Sequence[int], np.ndarray], ends: Union[Sequence[int], np.ndarray]):
        self.starts = np.asarray(starts, np.int64)
        lengths = np.asarray(ends, np.int64) - self.starts
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])

    @property
    def num_records(self) -> int:
        return int(self.offsets[-1])

    def indices(self, lo: int, hi: int) -> np.ndarray:
        """Record indices of stream positions ``[lo, hi)``."""
        if hi <= lo:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(start, start + count, dtype=np.int64) for start, count in self.runs(lo, hi)])

    def runs(self, lo: int, hi: int) -> List[Tuple[int, int]]:
        """Stream positions ``[lo, hi)`` as runs of consecutive record indices ``(first, count)``, in order.

        >>> EpochStream([10, 0], [15, 5]).runs(3, 7)
        [(13, 2), (0, 2)]
        """
        if hi <= lo:
            return []
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        last = int(np.searchsorted(self.offsets, hi, side="left"))
        runs = []
        for shard in range(first, last):
            a = max(lo, int(self.offsets[shard])) - int(self.offsets[shard])
            b = min(hi, int(self.offsets[shard + 1])) - int(self.offsets[shard])
            runs.append((int(self.starts[shard]) + a, b - a))
        return runs
