"""Which records each step and each rank take: a pure function of the data position.

The records of an epoch form one stream: the epoch's shards (index ranges,
in the order the coordinator hands out) one after the other. A position is a
*cursor* into that stream. From a cursor, with ``n`` workers and
``batch_size`` records per worker, every step takes the next ``n *
batch_size`` records and rank ``r`` takes the ``r``-th contiguous share of them
(split like ``np.array_split``). So each step consumes a contiguous run of
the stream, the records consumed so far are always exactly the first
``cursor`` ones, and a position is one number that every rank agrees on.

The last step of an epoch takes what is left. When that would leave fewer
records than workers for a final step, they are folded into the step before
(some workers then take ``batch_size + 1``), so that no worker gets an empty
batch unless the epoch has fewer records left than there are workers.
"""

from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple, Union

import numpy as np


def step_bounds(cursor: int, num_records: int, workers: int, batch_size: int) -> Iterator[Tuple[int, int]]:
    """Yields ``(start, end)`` stream positions of the steps from ``cursor`` to the end of the epoch.

    Example::

        list(step_bounds(0, 10, workers=2, batch_size=2))   # [(0, 4), (4, 8), (8, 10)]
        list(step_bounds(0, 9, workers=2, batch_size=2))    # [(0, 4), (4, 9)]: the 1 left is folded in
    """
    step = workers * batch_size
    while cursor < num_records:
        end = min(cursor + step, num_records)
        if 0 < num_records - end < workers:
            end = num_records
        yield cursor, end
        cursor = end


def next_cursor(cursor: int, num_records: int, workers: int, batch_size: int) -> int:
    """The cursor after one step taken at ``cursor``."""
    return next(step_bounds(cursor, num_records, workers, batch_size), (cursor, cursor))[1]


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
