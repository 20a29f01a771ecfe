"""Which all-reduce algorithm to run for a size and a number of ranks, from a cost model.

A LogP-style model of one data path (:class:`PathCosts`): a rank spends
``overhead_s`` of its own time on each message it sends or receives (serial
within the rank: Python, system calls, copies into the transport), a message
takes ``latency_s`` more to reach its peer (overlapping with other work), a
byte ``s_per_byte`` on the way, and reducing a byte ``reduce_s_per_byte``.
Predicted seconds for S bytes among N ranks (:func:`predict`):

- ``direct`` (:mod:`.direct`): every rank sends its array to every peer and
  reduces the N contributions: (N-1)(2o + Sβ + Sγ) + L;
- ``recursive_doubling`` (:mod:`.recursive_doubling`): log2(P) exchanges of
  the whole array, P the largest power of two <= N, plus a fold in and out of
  the N - P others: log2(P)(2o + L + Sβ + Sγ) + [N > P] (2(2o + L + Sβ) + Sγ);
- ``ring`` (:mod:`.ring`): 2(N-1) steps of S/N bytes:
  2(N-1)(2o + L + Sβ/N) + (N-1)Sγ/N;
- ``hierarchical`` (predicted only, for a job of H hosts with K workers
  each): a direct reduce to a leader over shared memory, the ring among the H
  leaders between hosts, and a broadcast back over shared memory.

:func:`choose` takes the fastest of the three that run, the direct exchange
only while its buffers stay small ((N-1)·S <= :data:`DIRECT_SEND_BYTES`).

>>> choose(4096, 2), choose(64 << 20, 2), choose(4096, 1024)
('direct', 'ring', 'recursive_doubling')
>>> predict("ring", 64 << 20, 1024) > predict("ring", 64 << 20, 2)  # 2046 steps of latency
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence, Tuple

import numpy as np

# The direct exchange holds (N-1) contributions of S bytes: only while they total at most this.
DIRECT_SEND_BYTES = 1 << 20

ALGORITHMS: Tuple[str, ...] = ("direct", "recursive_doubling", "ring")


@dataclasses.dataclass(frozen=True)
class PathCosts:
    """The costs of one data path (see the module docstring); seconds, and seconds per byte."""

    overhead_s: float
    latency_s: float
    s_per_byte: float
    reduce_s_per_byte: float


# Set to the quiet N = 2 medians of benchmarks/allreduce.py on the 2-core machine (issue 16's table:
# shared memory 4 KiB 0.08 ms, 4 MiB 1.34 ms, 64 MiB 11.4 ms; data socket 4 KiB 0.24 ms, 256 KiB 0.23 ms,
# 4 MiB 1.57 ms, 64 MiB 25.6 ms), predicted within 1.5x of each. Not fitted with :func:`fit`: at N = 2
# the direct exchange and recursive doubling have the same coefficients, so the wire and the reduction
# cannot be told apart, and at N >= 3 the ranks share the 2 cores (fit them on unshared cores).
SHARED_MEMORY = PathCosts(overhead_s=20e-6, latency_s=40e-6, s_per_byte=0.12e-9, reduce_s_per_byte=0.25e-9)
DATA_SOCKET = PathCosts(overhead_s=25e-6, latency_s=150e-6, s_per_byte=0.30e-9, reduce_s_per_byte=0.25e-9)


def coefficients(algorithm: str, nbytes: int, size: int) -> Tuple[float, float, float, float]:
    """The prediction's multipliers of (overhead, latency, seconds per byte, reduce seconds per byte):
    every prediction is linear in the path's costs, so they are fitted by least squares.

    Raises:
        ValueError: an unknown algorithm.
    """
    n, s = size, nbytes
    if n < 2:
        return (0.0, 0.0, 0.0, 0.0)
    if algorithm == "direct":
        return (2.0 * (n - 1), 1.0, float((n - 1) * s), float((n - 1) * s))
    if algorithm == "recursive_doubling":
        core = 1 << (n.bit_length() - 1)
        steps = math.log2(core)
        folded = 1.0 if n > core else 0.0
        return (2 * steps + 4 * folded, steps + 2 * folded, (steps + 2 * folded) * s, (steps + folded) * s)
    if algorithm == "ring":
        return (4.0 * (n - 1), 2.0 * (n - 1), 2.0 * (n - 1) * s / n, (n - 1) * s / n)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r} (one of {', '.join(ALGORITHMS)})")


def predict(algorithm: str, nbytes: int, size: int, path: PathCosts = SHARED_MEMORY) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` among ``size`` ranks.

    Raises:
        ValueError: an unknown algorithm.
    """
    a, b, c, d = coefficients(algorithm, nbytes, size)
    return a * path.overhead_s + b * path.latency_s + c * path.s_per_byte + d * path.reduce_s_per_byte


def predict_hierarchical(
    nbytes: int, hosts: int, per_host: int, local: PathCosts = SHARED_MEMORY, between: PathCosts = DATA_SOCKET
) -> float:
    """Predicted seconds of a hierarchical all-reduce: reduce to a leader per host, ring among the
    leaders, broadcast back (one message from the leader to each worker of its host)."""
    reduce_in = predict("direct", nbytes, per_host, local)  # the leader takes every contribution in
    send_out = (per_host - 1) * (2 * local.overhead_s + nbytes * local.s_per_byte) + local.latency_s
    return reduce_in + predict("ring", nbytes, hosts, between) + (send_out if per_host > 1 else 0.0)


@functools.lru_cache(maxsize=1024)  # asked at every all-reduce, mostly for the same few sizes
def choose(nbytes: int, size: int, path: PathCosts = SHARED_MEMORY) -> str:
    """The algorithm predicted fastest for ``nbytes`` among ``size`` ranks (``direct`` only while
    (N-1)·S <= :data:`DIRECT_SEND_BYTES`; ties go to the fewer rounds)."""
    allowed = [a for a in ALGORITHMS if a != "direct" or (size - 1) * nbytes <= DIRECT_SEND_BYTES]
    return min(allowed, key=lambda a: predict(a, nbytes, size, path))


def fit(samples: Sequence[Tuple[str, int, int, float]]) -> PathCosts:
    """The path costs that predict ``samples`` (algorithm, nbytes, N, measured seconds) best:
    least squares on the relative error, so that microseconds count as much as seconds; costs
    that come out negative (a term the samples cannot tell apart) are fitted again without them.

    Raises:
        ValueError: fewer samples than costs.
    """
    if len(samples) < 4:
        raise ValueError(f"fitting 4 costs needs at least 4 samples, not {len(samples)}")
    rows = np.array([coefficients(a, s, n) for a, s, n, _ in samples], dtype=np.float64)
    measured = np.array([t for *_, t in samples], dtype=np.float64)
    weights = 1.0 / measured
    kept = list(range(4))
    while True:
        solution, *_ = np.linalg.lstsq(rows[:, kept] * weights[:, None], measured * weights, rcond=None)
        if (solution >= 0).all() or len(kept) == 1:
            break
        kept.pop(int(np.argmin(solution)))
    costs = np.zeros(4)
    costs[kept] = np.maximum(solution, 0.0)
    return PathCosts(*(float(c) for c in costs))
