"""Ring algorithms over a :class:`~elasticdl_strategy.collective.p2p.PointToPoint` endpoint.

The array is cut into N segments (as evenly as possible, the first ones one
element longer). Reduce-scatter takes N-1 steps: each rank sends one segment to
its right neighbour and reduces the segment arriving from its left neighbour
into its own copy, as the chunks arrive. All-gather then circulates the
reduced segments for N-1 more steps. Each rank sends 2(N-1)/N of the data in
all, the bandwidth optimum for all-reduce.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Set, Tuple

import numpy as np

from elasticdl_strategy.collective import compression
from elasticdl_strategy.collective.mailbox import ArraySink, ReduceSink
from elasticdl_strategy.collective.p2p import COLLECTIVE_CHANNEL, PointToPoint, Request
from elasticdl_strategy.errors import CollectiveTimeoutError
from elasticdl_strategy.transport.protos import peer_pb2

Bounds = List[Tuple[int, int]]


def even_bounds(length: int, parts: int) -> Bounds:
    """Splits ``range(length)`` into ``parts`` contiguous pieces, the first ``length % parts`` one longer."""
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class CollectiveCall:
    """One collective in progress: the descriptor its messages carry, its deadline, its pending sends.

    A wait still blocked at ``warn_at`` calls ``on_slow(peers)`` once (the ranks it
    waits for, to log them), then waits on until the deadline.
    """

    def __init__(
        self,
        p2p: PointToPoint,
        descriptor: peer_pb2.CollectiveDescriptor,
        deadline: float,
        warn_at: Optional[float] = None,
        on_slow: Optional[Callable[[Set[int]], None]] = None,
    ):
        self.p2p = p2p
        self.descriptor = descriptor
        self.deadline = deadline
        self.sends: List[Request] = []
        self._warn_at = warn_at if on_slow is not None else None
        self._on_slow = on_slow

    def send(self, array: np.ndarray, dst: int) -> None:
        request = self.p2p.isend(array, dst, channel=COLLECTIVE_CHANNEL, collective=self.descriptor)
        if not request.succeeded():  # a send into a lane completes in isend: nothing to wait for
            self.sends.append(request)

    def recv_into(self, out: np.ndarray, src: int) -> Request:
        return self.p2p.irecv(src, channel=COLLECTIVE_CHANNEL, sink=ArraySink(self.p2p.rank, out))

    def recv_new(self, src: int) -> Request:
        return self.p2p.irecv(src, channel=COLLECTIVE_CHANNEL)

    def recv_reduce(self, acc: np.ndarray, ufunc: Callable, src: int) -> Request:
        return self.p2p.irecv(src, channel=COLLECTIVE_CHANNEL, sink=ReduceSink(self.p2p.rank, acc, ufunc))

    def recv_reduce_widening(self, acc: np.ndarray, ufunc: Callable, src: int, wire_dtype: np.dtype) -> Request:
        sink = compression.WideningReduceSink(self.p2p.rank, acc, ufunc, wire_dtype)
        return self.p2p.irecv(src, channel=COLLECTIVE_CHANNEL, sink=sink)

    def wait(self, request: Request):
        now = time.monotonic()
        if self._warn_at is not None and self._on_slow is not None and now < self._warn_at < self.deadline:
            try:
                return request.wait(timeout=self._warn_at - now)
            except CollectiveTimeoutError:
                self._warn_at = None
                self._on_slow({request.peer})
        return request.wait(timeout=max(0.0, self.deadline - time.monotonic()))

    def warn_if_slow(self, now: float, peers: Sequence[int]) -> None:
        """For a wait on something other than a request: ``on_slow(peers)`` once ``warn_at`` has passed."""
        if self._warn_at is not None and self._on_slow is not None and now >= self._warn_at:
            self._warn_at = None
            self._on_slow(set(peers))

    def finish_sends(self) -> None:
        for request in self.sends:
            self.wait(request)
        self.sends = []


class _Ring:
    """The ring through ``members`` (ranks, in ring order; default all): this rank's position
    in it and its neighbours."""

    __slots__ = ("size", "position", "left", "right")

    def __init__(self, call: CollectiveCall, members: Optional[Sequence[int]] = None):
        rank = call.p2p.rank
        members = range(call.p2p.size) if members is None else members
        self.size, self.position = len(members), members.index(rank)
        self.left = members[(self.position - 1) % self.size]
        self.right = members[(self.position + 1) % self.size]


def reduce_scatter(
    call: CollectiveCall, flat: np.ndarray, bounds: Sequence[Tuple[int, int]], ufunc: Callable, owned: int
) -> None:
    """Ring reduce-scatter in place on the 1-D ``flat``.

    Afterwards segment ``(rank + owned) % N`` of ``flat`` holds the reduction over all ranks.
    """
    ring = _Ring(call)
    _run(call, ring, flat, bounds, owned - 1, _post_reduce_scatter(call, ring, flat, bounds, ufunc, owned))


def allgather(call: CollectiveCall, flat: np.ndarray, bounds: Sequence[Tuple[int, int]], owned: int) -> None:
    """Ring all-gather in place on the 1-D ``flat``, each rank starting with segment ``(rank + owned) % N``."""
    ring = _Ring(call)
    _run(call, ring, flat, bounds, owned, _post_allgather(call, ring, flat, bounds, owned))


def allreduce(call: CollectiveCall, flat: np.ndarray, ufunc: Callable, members: Optional[Sequence[int]] = None) -> None:
    """Bandwidth-optimal ring all-reduce in place on the 1-D ``flat``, among ``members`` (ranks in
    ring order, this one included; default all).

    Every receive of both phases is posted before the first send, each into its
    own segment, so a neighbour running ahead has its data reduced or stored as
    it arrives instead of buffered (a copy, and memory) until asked for. That
    is safe: a segment's data only reaches this rank after this rank's own use
    of that segment (its send, or its reduction) is complete.
    """
    ring = _Ring(call, members)
    bounds = even_bounds(flat.size, ring.size)
    reduced = _post_reduce_scatter(call, ring, flat, bounds, ufunc, owned=1)
    gathered = _post_allgather(call, ring, flat, bounds, owned=1)
    _run(call, ring, flat, bounds, 0, reduced)
    _run(call, ring, flat, bounds, 1, gathered)


def _post_reduce_scatter(call: CollectiveCall, ring: _Ring, flat, bounds, ufunc: Callable, owned: int) -> List[Request]:
    """Receives of reduce-scatter step s (from the left, reduced into segment position + owned - 2 - s)."""
    n, position = ring.size, ring.position
    segments = [bounds[(position + owned - 2 - s) % n] for s in range(n - 1)]
    return [call.recv_reduce(flat[a:b], ufunc, ring.left) for a, b in segments]


def _post_allgather(call: CollectiveCall, ring: _Ring, flat, bounds, owned: int) -> List[Request]:
    """Receives of all-gather step s (from the left, into segment position + owned - 1 - s)."""
    n, position = ring.size, ring.position
    segments = [bounds[(position + owned - 1 - s) % n] for s in range(n - 1)]
    return [call.recv_into(flat[a:b], ring.left) for a, b in segments]


def _run(call: CollectiveCall, ring: _Ring, flat, bounds, first: int, requests: List[Request]) -> None:
    """Sends segment position + first - s to the right at step s, then waits for receive s
    (whose segment, position + first - 1 - s, is the one sent at step s + 1)."""
    for s, request in enumerate(requests):
        a, b = bounds[(ring.position + first - s) % ring.size]
        call.send(flat[a:b], ring.right)
        call.wait(request)


def reduce_scatter_compressed(
    call: CollectiveCall,
    flat: np.ndarray,
    bounds: Sequence[Tuple[int, int]],
    ufunc: Callable,
    send16: np.ndarray,
    owned: int,
) -> None:
    """Ring reduce-scatter in place on the 1-D float ``flat`` with a 16-bit wire.

    Each step rounds the segment it sends into ``send16`` (16-bit, the length
    of ``flat``; each segment goes to its own place, so no send waits for an
    earlier one) and widens the incoming segment into ``flat``. Afterwards
    segment ``(rank + owned) % N`` of ``flat`` holds the reduction over all ranks.
    """
    p2p = call.p2p
    n, rank = p2p.size, p2p.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):
        send_a, send_b = bounds[(rank + owned - 1 - s) % n]
        recv_a, recv_b = bounds[(rank + owned - 2 - s) % n]
        request = call.recv_reduce_widening(flat[recv_a:recv_b], ufunc, left, send16.dtype)
        compression.encode(flat[send_a:send_b], send16[send_a:send_b])
        call.send(send16[send_a:send_b], right)
        call.wait(request)


def allgather_compressed(
    call: CollectiveCall,
    flat: np.ndarray,
    bounds: Sequence[Tuple[int, int]],
    send16: np.ndarray,
    recv16: np.ndarray,
    owned: int,
) -> None:
    """Ring all-gather of 16-bit segments, widened into the 1-D float ``flat``.

    Each rank starts with its segment ``(rank + owned) % N`` already rounded in
    ``send16`` (and widened back into ``flat``); the others arrive in ``recv16``,
    are forwarded from there unchanged and widened into ``flat``.
    """
    p2p = call.p2p
    n, rank = p2p.size, p2p.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    pending = None
    for s in range(n - 1):
        send_a, send_b = bounds[(rank + owned - s) % n]
        recv_a, recv_b = bounds[(rank + owned - 1 - s) % n]
        request = call.recv_into(recv16[recv_a:recv_b], left)
        call.send((send16 if s == 0 else recv16)[send_a:send_b], right)
        if pending is not None:  # widen the previous segment while this one travels
            compression.decode(recv16[pending[0] : pending[1]], flat[pending[0] : pending[1]])
        call.wait(request)
        pending = (recv_a, recv_b)
    if pending is not None:
        compression.decode(recv16[pending[0] : pending[1]], flat[pending[0] : pending[1]])


def allreduce_compressed(
    call: CollectiveCall, flat: np.ndarray, ufunc: Callable, send16: np.ndarray, recv16: np.ndarray
) -> None:
    """Ring all-reduce in place on the 1-D float ``flat``, 16-bit values on the wire.

    ``send16`` and ``recv16`` are 16-bit staging buffers of ``flat``'s length.
    The owner of each reduced segment rounds it to 16 bits and keeps the
    rounded value itself too, so every rank ends with the same bits.
    """
    bounds = even_bounds(flat.size, call.p2p.size)
    reduce_scatter_compressed(call, flat, bounds, ufunc, send16, owned=1)
    own_a, own_b = bounds[(call.p2p.rank + 1) % call.p2p.size]
    compression.encode(flat[own_a:own_b], send16[own_a:own_b])
    compression.decode(send16[own_a:own_b], flat[own_a:own_b])
    allgather_compressed(call, flat, bounds, send16, recv16, owned=1)
