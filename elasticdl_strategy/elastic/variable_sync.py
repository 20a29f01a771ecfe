"""Which members receive rank 0's variables in a state sync, and sending them there.

Commits keep every member's variables identical, so a member whose variables
still hold, bit for bit, the snapshot of rank 0's commit needs nothing: after a
failure every survivor rolled back to the same commit, and when a worker joins
only the newcomer lacks it. Each member tells (one small all-gather) which
commit its variables hold; :func:`plan` decides from that alone who receives,
and how:

* nobody: every member holds rank 0's commit (survivors of a failure or leave);
* a few members (:data:`SEND_TO_AT_MOST`, e.g. one newcomer): rank 0 sends the
  variables straight to each of them (a scatter; the others get nothing);
* more: a broadcast to everyone (scatter and ring all-gather, so rank 0 does not
  send the whole state once per receiver).

Example (what :meth:`~elasticdl_strategy.elastic.State.sync` does)::

    commits = held_commits(communicator, this_workers_held_commit)
    transfer = plan(commits)
    received = send(communicator, variables, transfer)  # rank 0's values here, or None
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from elasticdl_strategy.collective.communicator import Communicator
from elasticdl_strategy.errors import CollectiveMismatchError

# Receivers that rank 0 sends the variables to one by one; beyond this a broadcast moves them.
SEND_TO_AT_MOST = 2
# Variables of one dtype travel fused in messages of up to this many bytes, one larger alone and
# without a copy: rank 0 never holds a second copy of the whole state, and starts sending at once.
GROUP_BYTES = 4 << 20
NO_COMMIT = -1  # held by a member whose variables hold no kept snapshot


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Who receives rank 0's variables in a sync, and how."""

    receivers: Tuple[int, ...]  # ranks whose variables become rank 0's
    broadcast: bool  # to every rank at once (else straight from rank 0 to each receiver)


def plan(commits: Sequence[int]) -> Transfer:
    """The transfer that gives every rank rank 0's variables, given the commit whose snapshot
    each rank's variables hold bit for bit (``NO_COMMIT``: none): every rank that does not hold
    rank 0's commit receives; when rank 0 holds none, every other rank does.

    >>> plan([7, 7, 7])
    Transfer(receivers=(), broadcast=False)
    >>> plan([7, 7, NO_COMMIT])
    Transfer(receivers=(2,), broadcast=False)
    >>> plan([7, 6, 7, NO_COMMIT])
    Transfer(receivers=(1, 3), broadcast=False)
    >>> plan([NO_COMMIT, 7, 7, 7])
    Transfer(receivers=(1, 2, 3), broadcast=True)
    """
    receivers = tuple(r for r in range(1, len(commits)) if commits[0] == NO_COMMIT or commits[r] != commits[0])
    return Transfer(receivers, broadcast=len(receivers) > SEND_TO_AT_MOST)


def held_commits(communicator: Communicator, held: int) -> List[int]:
    """Every rank's ``held`` commit (this rank's: the commit whose snapshot its variables hold
    bit for bit, or ``NO_COMMIT``), by rank: one all-gather of one integer per rank."""
    return communicator.allgather(np.array([held], np.int64)).tolist()


def send(communicator: Communicator, values: Sequence[np.ndarray], transfer: Transfer) -> Optional[List[np.ndarray]]:
    """Moves rank 0's ``values`` (the variables' values, read on every rank: their shapes and
    dtypes agree) to ``transfer.receivers``: one collective per dtype, called on every rank.

    Returns:
        On a receiver, rank 0's values, one array per variable (views of buffers it never wrote
        before: a newcomer touches its fresh memory once); ``None`` elsewhere.
    """
    if not transfer.receivers:
        return None
    receiving = communicator.rank in transfer.receivers
    received: List[np.ndarray] = [np.empty(0)] * len(values)
    for members in groups(values):
        fused = _fused(communicator, [values[i] for i in members], transfer)  # on every rank
        if receiving:
            offsets = np.cumsum([0] + [values[i].size for i in members])
            for i, start, end in zip(members, offsets[:-1], offsets[1:]):
                received[i] = fused[start:end].reshape(values[i].shape)
    return received if receiving else None


def groups(values: Sequence[np.ndarray], group_bytes: Optional[int] = None) -> List[List[int]]:
    """The indices of ``values`` by message, in the order they travel: those of one dtype in order,
    fused up to ``group_bytes`` (default :data:`GROUP_BYTES`), one of ``group_bytes`` or more alone.
    From shapes and dtypes only, so the same on every rank.

    >>> f32, i64 = np.zeros(3, np.float32), np.zeros(1, np.int64)
    >>> groups([f32, i64, f32, np.zeros(8, np.float32), f32], group_bytes=32)
    [[3], [0, 2], [4], [1]]
    """
    group_bytes = GROUP_BYTES if group_bytes is None else group_bytes
    by_dtype: Dict[np.dtype, List[int]] = {}
    for i, value in enumerate(values):
        by_dtype.setdefault(value.dtype, []).append(i)
    messages: List[List[int]] = []
    for members in by_dtype.values():
        fused: List[int] = []
        fused_bytes = 0
        for i in members:
            nbytes = values[i].nbytes
            if nbytes >= group_bytes:
                messages.append([i])
                continue
            if fused and fused_bytes + nbytes > group_bytes:
                messages.append(fused)
                fused, fused_bytes = [], 0
            fused.append(i)
            fused_bytes += nbytes
        if fused:
            messages.append(fused)
    return messages


def _fused(communicator: Communicator, values: List[np.ndarray], transfer: Transfer) -> np.ndarray:
    """Rank 0's ``values`` (of one dtype), as one flat array, on the receivers (an empty array
    elsewhere); a single value goes without a copy."""
    rank, dtype = communicator.rank, values[0].dtype
    total = sum(v.size for v in values)
    if transfer.broadcast:
        fused = _flat(values) if rank == 0 else np.empty(total, dtype)
        return communicator.broadcast(fused, root=0, out=fused)
    if rank != 0:
        fused = communicator.scatter(None, root=0)
        expected = total if rank in transfer.receivers else 0
        if fused.dtype != dtype or fused.size != expected:
            raise CollectiveMismatchError(
                f"rank {rank}: rank 0 sent {fused.size} {fused.dtype} values of the state, {expected} {dtype} "
                "expected; every worker must build the same model and state",
                ranks=[0],
                rank=rank,
            )
        return fused
    fused = _flat(values)
    nothing = np.empty(0, dtype)
    return communicator.scatter([fused if r in transfer.receivers else nothing for r in range(communicator.size)])


def _flat(values: List[np.ndarray]) -> np.ndarray:
    """``values`` as one flat array: a view of a single contiguous one, else a concatenation."""
    if len(values) == 1:
        return np.ascontiguousarray(values[0]).reshape(-1)
    return np.concatenate([v.reshape(-1) for v in values])
