"""Latency-optimal all-reduce for small arrays: every rank sends its array to every other rank.

The ring takes 2(N-1) message latencies one after another; for a few KiB that
latency is the whole cost. Here each rank sends its whole array to all peers
at once and reduces the N contributions itself, in rank order 0..N-1, so every
rank computes the same operations on the same values and gets the same bits.
Each rank sends (N-1)·S bytes instead of the ring's 2(N-1)/N·S, which costs
nothing at these sizes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from elasticdl_strategy.collective.ring import CollectiveCall


def allreduce(call: CollectiveCall, flat: np.ndarray, ufunc: Callable) -> None:
    """All-reduces the 1-D ``flat`` in place by a direct exchange with every peer."""
    p2p = call.p2p
    peers = [r for r in range(p2p.size) if r != p2p.rank]
    contributions = {r: np.empty_like(flat) for r in peers}
    requests = {r: call.recv_into(contributions[r], r) for r in peers}
    for r in peers:
        call.send(flat, r)
    for r in peers:
        call.wait(requests[r])
    call.finish_sends()  # flat is overwritten below
    if p2p.rank == 0:  # its own array is the start of the sum
        first = 1
    else:  # rank 1's own array is the second operand, read as the sum is written; later ranks' are kept
        contributions[p2p.rank] = flat if p2p.rank == 1 else flat.copy()
        ufunc(contributions[0], contributions[1], out=flat)
        first = 2
    for r in range(first, p2p.size):
        ufunc(flat, contributions[r], out=flat)
