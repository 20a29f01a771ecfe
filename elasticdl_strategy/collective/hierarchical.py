"""Hierarchical all-reduce: within a host over shared memory, between hosts once per host.

With several workers per host, a flat ring sends every byte between hosts once per worker on
the host boundary (at N = 4 on 2 hosts, 1.5 times the array each way with the ranks in host
order, 3 times with them interleaved). Here each host's lowest rank, its leader, reduces the
arrays of its host's workers into its own (in rank order: the same additions on every run),
the leaders all-reduce among themselves by the ring (2(H-1)/H of the array between H hosts,
once per host), and each leader sends the result to its host's workers. Every rank ends with
the leaders' ring result: the same bits everywhere. The array goes through this in pieces of
:data:`PIECE_BYTES`, so that the work within a host on one piece overlaps the ring of the one
before on the link between hosts.

Which ranks share a host comes from the membership (:func:`host_groups` of what each worker
reported, ``EDL_HOST_ID``, else its address's host); the communicator picks this for arrays
the flat ring would take, when some host has more than one worker and there is more than one
host, unless ``EDL_HIERARCHICAL=0``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from elasticdl_strategy.collective import ring
from elasticdl_strategy.collective.ring import CollectiveCall


def host_groups(hosts: Sequence[str]) -> List[List[int]]:
    """The ranks of each host, hosts in the order of their lowest rank, each group in rank order.

    >>> host_groups(["a", "b", "a", "b", "c"])
    [[0, 2], [1, 3], [4]]
    """
    groups: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


def applies(groups: Sequence[Sequence[int]]) -> bool:
    """Whether a hierarchical all-reduce differs from the flat one: several hosts, one with several ranks."""
    return len(groups) > 1 and any(len(group) > 1 for group in groups)


PIECE_BYTES = 4 << 20  # the pipeline's unit: a host's reduction of one piece overlaps the ring of the last


def pieces(nbytes: int, itemsize: int) -> List[Tuple[int, int]]:
    """Element ranges of the pieces of a ``nbytes`` array (one piece when it is small).

    >>> pieces(10 << 20, 4)
    [(0, 1048576), (1048576, 2097152), (2097152, 2621440)]
    """
    per_piece = max(1, PIECE_BYTES // itemsize)
    elements = nbytes // itemsize
    return [(start, min(start + per_piece, elements)) for start in range(0, max(elements, 1), per_piece)]


def allreduce(call: CollectiveCall, flat: np.ndarray, ufunc: Callable, groups: Sequence[Sequence[int]]) -> None:
    """All-reduces the 1-D ``flat`` in place: to each host's leader, around the leaders, back out,
    piece by piece, so that the host's transfers of one piece overlap the ring of the one before."""
    rank = call.p2p.rank
    local = next(group for group in groups if rank in group)
    leader, members = local[0], local[1:]
    spans = pieces(flat.nbytes, flat.itemsize)
    if rank != leader:
        # Posted before the sends: a piece's result only comes once the leader has that piece from here.
        results = [call.recv_into(flat[a:b], leader) for a, b in spans]
        for a, b in spans:
            call.send(flat[a:b], leader)
        for result in results:
            call.wait(result)
        return
    leaders = [group[0] for group in groups]
    # Every member's pieces are received (and reduced) in rank order, piece by piece: the first
    # member's are posted now, each next member's piece once the one before it was reduced in.
    first = [call.recv_reduce(flat[a:b], ufunc, members[0]) for a, b in spans] if members else []
    for index, (a, b) in enumerate(spans):
        for member in members:
            call.wait(first[index] if member == members[0] else call.recv_reduce(flat[a:b], ufunc, member))
        if len(leaders) > 1:
            ring.allreduce(call, flat[a:b], ufunc, members=leaders)
        for member in members:
            call.send(flat[a:b], member)
