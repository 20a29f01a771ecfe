"""The job's dataset as the coordinator sees it: shards of record indices, reshuffled per epoch.

Records ``0 .. num_records-1`` are cut into shards of ``shard_size``
consecutive indices (index ranges, so that a file- or TFRecord-backed dataset
reads contiguous runs). Each epoch consumes every shard once, in an order
shuffled with ``(seed, epoch)``; the coordinator hands the order out, and
workers consume it as one stream of records (see :mod:`elasticdl_strategy.data`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, Tuple

import numpy as np

from elasticdl_strategy.errors import UsageError


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a job reads: validated at construction, with messages naming the bad value."""

    num_records: int
    shard_size: int
    seed: int = 0
    shuffle: bool = True
    fingerprint: str = ""  # what the records are, so that workers reading different data are refused

    def __post_init__(self) -> None:
        if self.num_records < 1:
            raise UsageError(f"num_records={self.num_records} must be at least 1")
        if self.shard_size < 1:
            raise UsageError(f"shard_size={self.shard_size} must be at least 1")
        if not 0 <= self.seed < 2**63:
            raise UsageError(f"seed={self.seed} must be a non-negative 64-bit integer")

    def shards(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """Returns ``(starts, ends)`` of the shards of ``epoch`` in consumption order."""
        starts = np.arange(0, self.num_records, self.shard_size, dtype=np.int64)
        ends = np.minimum(starts + self.shard_size, self.num_records)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(starts))
            starts, ends = starts[order], ends[order]
        return starts, ends


class ShardTables:
    """The registered dataset of a job and its per-epoch shard orders (the last few cached)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spec: DatasetSpec | None = None
        self._cache: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    def get(self, spec: DatasetSpec, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """Registers ``spec`` on first use; returns the shard order of ``epoch``.

        Raises:
            UsageError: ``spec`` differs from the one registered first (names both).
        """
        if epoch < 0:
            raise UsageError(f"epoch={epoch} must not be negative")
        with self._lock:
            if self.spec is None:
                self.spec = spec
            elif spec != self.spec:
                raise UsageError(f"this worker's dataset {spec} differs from the job's {self.spec}")
            if epoch not in self._cache:
                if len(self._cache) >= 4:
                    self._cache.pop(min(self._cache))
                self._cache[epoch] = self.spec.shards(epoch)
            return self._cache[epoch]
