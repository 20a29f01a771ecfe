"""Recursive doubling: a latency-optimal all-reduce for small arrays among many ranks.

In log2(P) steps (P the largest power of two <= N) every rank exchanges its
partial result with the rank whose number differs in one bit, and both combine
the two the same way, the lower rank's operand first: after the step with bit
k, the 2^(k+1) ranks that agree on the higher bits hold the same bits. With N
not a power of two, each rank P + i first hands its array to rank i, which
reduces it in (its own operand first), and gets the result back at the end.

Each rank sends log2(P) messages of the whole array (one more for the N - P
ranks of the fold), against 2(N-1) for the ring and N-1 for the direct
exchange: the choice for small arrays once N is large
(:mod:`~elasticdl_strategy.collective.cost_model`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from elasticdl_strategy.collective.ring import CollectiveCall


def allreduce(call: CollectiveCall, flat: np.ndarray, ufunc: Callable) -> None:
    """All-reduces the 1-D ``flat`` in place by recursive doubling; every rank gets the same bits."""
    size, rank = call.p2p.size, call.p2p.rank
    core = 1 << (size.bit_length() - 1)
    if rank >= core:  # folded in: hand over the array, get the result back
        call.send(flat, rank - core)
        call.finish_sends()  # flat is overwritten by the result
        call.wait(call.recv_into(flat, rank - core))
        return
    buffer = np.empty_like(flat)
    folded = rank + core if rank + core < size else None
    if folded is not None:
        call.wait(call.recv_into(buffer, folded))
        ufunc(flat, buffer, out=flat)
    bit = 1
    while bit < core:
        partner = rank ^ bit
        request = call.recv_into(buffer, partner)
        call.send(flat, partner)
        call.wait(request)
        call.finish_sends()  # flat is overwritten below
        if rank < partner:
            ufunc(flat, buffer, out=flat)
        else:
            ufunc(buffer, flat, out=flat)
        bit <<= 1
    if folded is not None:
        call.send(flat, folded)
