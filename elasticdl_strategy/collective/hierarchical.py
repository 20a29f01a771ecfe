"""Hierarchical all-reduce: within a host over shared memory, between hosts once per host.

With several workers per host, a flat ring sends every byte between hosts once per worker on
the host boundary (at N = 4 on 2 hosts, 1.5 times the array each way with the ranks in host
order, 3 times with them interleaved). Here each host's lowest rank, its leader, reduces the
arrays of its host's workers into its own (in rank order: the same additions on every run),
the leaders all-reduce among themselves by the ring (2(H-1)/H of the array between H hosts,
once per host), and each leader sends the result to its host's workers. Every rank ends with
the leaders' ring result: the same bits everywhere.

Which ranks share a host comes from the addresses the coordinator hands out
(:func:`host_groups`); the communicator picks this for arrays the flat ring would take, when
some host has more than one worker and there is more than one host, unless
``EDL_HIERARCHICAL=0``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

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


def allreduce(call: CollectiveCall, flat: np.ndarray, ufunc: Callable, groups: Sequence[Sequence[int]]) -> None:
    """All-reduces the 1-D ``flat`` in place: to each host's leader, around the leaders, back out."""
    rank = call.p2p.rank
    local = next(group for group in groups if rank in group)
    leader = local[0]
    if rank != leader:
        # Posted before the send: the result only comes once the leader has all of this array.
        result = call.recv_into(flat, leader)
        call.send(flat, leader)
        call.wait(result)
        return
    for member in local[1:]:  # one at a time, in rank order
        call.wait(call.recv_reduce(flat, ufunc, member))
    leaders = [group[0] for group in groups]
    if len(leaders) > 1:
        ring.allreduce(call, flat, ufunc, members=leaders)
    for member in local[1:]:
        call.send(flat, member)
