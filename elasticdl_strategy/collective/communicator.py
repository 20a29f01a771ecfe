"""Collectives for one membership: all-reduce, broadcast, gathers, scatters, barrier.

Every collective message carries a :class:`CollectiveDescriptor` (sequence
number, op, dtype, agreed shape, reduce op, root). Each rank compares the
descriptors it receives with its own call; a difference aborts the collective
on every rank with :class:`CollectiveMismatchError`. A peer failure, a
mismatch or a timeout seen by one rank is broadcast to all (``Peer.Abort``) so
nobody waits for its deadline. After such an error the communicator is
*aborted*: every later collective raises the same error until a new
communicator is built (the elastic layer does that).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set

import numpy as np
from google.protobuf.message import DecodeError

from elasticdl_strategy.collective import compression as wire_compression
from elasticdl_strategy.collective import cost_model, direct, hierarchical, host_allreduce, recursive_doubling, ring
from elasticdl_strategy.collective.dtypes import as_supported_array, check_reduce_op, dtype_name
from elasticdl_strategy.collective.p2p import COLLECTIVE_CHANNEL, PointToPoint
from elasticdl_strategy.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicationError,
    PeerFailureError,
    UsageError,
)
from elasticdl_strategy.transport.data_socket import host_of
from elasticdl_strategy.transport.protos import peer_pb2

logger = logging.getLogger(__name__)

# Broadcasts up to this size go straight from the root to every rank; larger
# ones are scattered and then all-gathered around the ring.
_DIRECT_BROADCAST_BYTES = 256 << 10
_NOTHING = np.zeros(0, np.uint8)  # what a barrier through the host segment reduces
_ALLREDUCE = {"direct": direct.allreduce, "recursive_doubling": recursive_doubling.allreduce, "ring": ring.allreduce}


def _describe(d: peer_pb2.CollectiveDescriptor) -> str:
    parts = []
    if d.dtype:
        parts.append(f"dtype={d.dtype}")
    if d.op != "barrier" and d.op != "scatter":
        shape = tuple("*" if x < 0 else x for x in d.shape)
        parts.append(f"shape={shape}".replace("'*'", "*"))
    if d.reduce_op:
        parts.append(f"op={d.reduce_op}")
    if d.root >= 0:
        parts.append(f"root={d.root}")
    if d.compression:
        parts.append(f"compression={d.compression}")
    return f"{d.op}({', '.join(parts)})"


def _as_number(mine: peer_pb2.CollectiveDescriptor, theirs: peer_pb2.CollectiveDescriptor) -> str:
    return f" as its collective #{theirs.sequence}" if theirs.sequence != mine.sequence else ""


def _differences(mine: peer_pb2.CollectiveDescriptor, theirs: peer_pb2.CollectiveDescriptor) -> List[str]:
    fields = ("sequence", "op", "dtype", "reduce_op", "root", "compression")
    differs = [f for f in fields if getattr(mine, f) != getattr(theirs, f)]
    if list(mine.shape) != list(theirs.shape):
        differs.append("shape")
    return differs


class Communicator:
    """Collectives over the ranks of one membership.

    Most code uses the module-level functions of :mod:`elasticdl_strategy.runtime`,
    which call the communicator that ``runtime.init()`` made for the current membership.

    Args:
        p2p: the point-to-point endpoint of this membership.
        timeout_s: default deadline of every collective.

    Collectives must be called from one thread at a time, in the same order on every rank.
    """

    def __init__(self, p2p: PointToPoint, timeout_s: Optional[float] = None, hosts: Optional[Sequence[str]] = None):
        self.p2p = p2p
        self.timeout_s = timeout_s if timeout_s is not None else p2p.options.timeout_s
        # Which ranks share a host: from their addresses unless given (tests stand in for hosts).
        groups = hierarchical.host_groups(hosts if hosts is not None else [host_of(a) for a in p2p.addresses])
        self._host_groups = groups if p2p.options.hierarchical and hierarchical.applies(groups) else None
        # Small all-reduces of ranks all on one host go through a host segment, set up by the first.
        self._host_segment_possible = self.size > 1 and host_allreduce.possible(len(groups) == 1)
        self._host_segment: Optional[host_allreduce.HostAllreduce] = None
        self._lock = threading.Lock()
        self._sequence = 0
        self._current: Optional[peer_pb2.CollectiveDescriptor] = None
        self._early: Dict[int, List[tuple]] = {}
        self._error_factory: Optional[Callable[[], CommunicationError]] = None
        self._abort_request: Optional[peer_pb2.AbortRequest] = None
        self._active: Optional[ring.CollectiveCall] = None
        self._staging = wire_compression.StagingBuffers()  # 16-bit buffers of compressed all-reduces
        p2p.header_observer = self._observe
        p2p.abort_observer = self._on_remote_abort
        p2p.failure_observer = self._on_peer_failure

    @property
    def rank(self) -> int:
        return self.p2p.rank

    @property
    def size(self) -> int:
        return self.p2p.size

    @property
    def collectives_called(self) -> int:
        """How many collectives this rank has called on this communicator."""
        return self._sequence

    @property
    def failure(self) -> Optional[CommunicationError]:
        """The error every collective raises since this communicator aborted; ``None`` while healthy."""
        factory = self._error_factory
        return factory() if factory is not None else None

    # ---- collectives ----------------------------------------------------------------------

    def allreduce(
        self,
        array,
        op: str = "sum",
        out: Optional[np.ndarray] = None,
        timeout: Optional[float] = None,
        compression: Optional[str] = None,
    ) -> np.ndarray:
        """Reduces ``array`` over all ranks; every rank gets the bitwise-identical result.

        Large arrays go around the bandwidth-optimal ring (reduce-scatter, then
        all-gather: each rank sends 2(N-1)/N of the bytes); small ones are sent
        to every peer at once and reduced in rank order (one message latency
        instead of 2(N-1)), or, among many ranks, reduced by recursive doubling
        (log2 N exchanges): :mod:`~elasticdl_strategy.collective.cost_model` picks.
        Among ranks all on one host, arrays up to ``host_segment_bytes`` (transport
        options) take one round through a host segment instead, without messages
        (:mod:`~elasticdl_strategy.collective.host_allreduce`); the same bits. Larger
        ones go through it too where the ranks may read each other's memory
        (``single_copy``): each reduces its part reading the others' arrays where
        they lie, then reads their reduced parts.

        Args:
            array: any shape, any size (0 included), a supported dtype.
            op: "sum", "mean", "min", "max" or "prod".
            out: optional C-contiguous array of the same shape and dtype to
                write the result into (may be ``array`` itself, for in-place).
            timeout: seconds; default the communicator's.
            compression: ``None`` or "none" (exact), or "fp16" / "bf16": the
                values travel as 16-bit floats, halving the bytes of a float32
                all-reduce. Only for float32/float64 arrays and ops "sum",
                "mean", "min", "max"; every rank must pass the same value.

        With compression, each value is rounded once to 16 bits before it is
        sent, the partial sums accumulate in float32 (float64 for float64
        arrays), and the final result is rounded once more to 16 bits. The
        error per element is thus about 2^-8 (bf16) or 2^-11 (fp16) relative
        to the largest magnitudes involved (inputs and partial sums), growing
        with the number of ranks. fp16 values beyond 65504 (inputs, partial
        sums or the result) become inf; bf16 has float32's range. With a
        single rank there is no wire and the result is exact.

        Returns:
            the reduced array (``out`` when given).
        """
        array = as_supported_array(array)
        ufunc = check_reduce_op(op, array.dtype)
        if compression is not None:
            wire = wire_compression.check_compression(compression, array.dtype, op)
            if wire is not None:
                return self._allreduce_compressed(array, op, ufunc, out, timeout, wire)
        result = self._output_buffer(array, out)
        segment = self._host_segment_takes(result.nbytes)
        call = self._begin("allreduce", array.dtype, array.shape, reduce_op=op, timeout=timeout, announce=not segment)
        with self._running(call):
            if self.size > 1 and not (segment and self._through_host_segment(call, result.reshape(-1), ufunc)):
                algorithm = cost_model.choose(result.nbytes, self.size)
                if algorithm == "ring" and self._host_groups is not None:
                    hierarchical.allreduce(call, result.reshape(-1), ufunc, self._host_groups)
                else:
                    _ALLREDUCE[algorithm](call, result.reshape(-1), ufunc)
                call.finish_sends()
        if op == "mean":
            np.divide(result, self.size, out=result, casting="unsafe")
        return result

    def allreduce_pieces(
        self,
        pieces: Sequence[np.ndarray],
        offsets: Sequence[int],
        out: np.ndarray,
        op: str = "sum",
        timeout: Optional[float] = None,
    ) -> np.ndarray:
        """All-reduces arrays laid out in one flat array: ``out[offsets[i] : offsets[i] + pieces[i].size]``
        becomes ``pieces[i]`` reduced over all ranks. The same as copying the pieces into ``out``
        and :meth:`allreduce` of ``out`` in place, but where that all-reduce would read the ranks'
        arrays where they lie (one host, ``single_copy``, larger than the host segment's slots:
        :meth:`reads_pieces`), the ranks read each other's pieces where they lie instead, and the
        pieces are never copied into ``out``. Elements of ``out`` that no piece covers end up
        unspecified (0 or what the copy left). Every rank passes the same layout (pieces of the
        same sizes at the same offsets): a different number of pieces is found out (a collective
        mismatch), other differences are not.

        Args:
            pieces: C-contiguous arrays of ``out``'s dtype, any shape (read as 1-D).
            offsets: where each piece starts in ``out``, in elements: increasing, the pieces within
                ``out`` and not overlapping.
            out: a 1-D C-contiguous array.
            op, timeout: as for :meth:`allreduce`.

        Returns:
            ``out``.

        Raises:
            UsageError: pieces that do not fit ``out`` as described.
            as :meth:`allreduce` otherwise.

        Example (two ranks; a model's gradients fused into one buffer without packing them)::

            grads = [np.ones((4, 3), np.float32), np.ones(3, np.float32)]
            flat = np.empty(16, np.float32)
            communicator.allreduce_pieces(grads, [0, 12], flat)  # flat[:12] and flat[12:15] hold 2.0
        """
        flats = _pieces_of(pieces, offsets, out)
        ufunc = check_reduce_op(op, out.dtype)
        if not self.reads_pieces(out.nbytes, len(flats)):
            for piece, offset in zip(flats, offsets, strict=True):
                out[offset : offset + piece.size] = piece
            return self.allreduce(out, op=op, out=out, timeout=timeout)
        segment = self._host_segment
        assert segment is not None
        # The number of pieces in the shape: ranks that pass different numbers are a mismatch.
        shape = (out.size, len(flats))
        call = self._begin("allreduce_pieces", out.dtype, shape, reduce_op=op, timeout=timeout, announce=False)
        with self._running(call):
            note = call.descriptor.SerializeToString()
            differing = segment.allreduce_pieces(
                call, flats, offsets, out, ufunc, note, self._raise_if_aborted, _elsewhere
            )
            for src, theirs in differing.items():
                self._check(call.descriptor, src, peer_pb2.CollectiveDescriptor.FromString(theirs))
            self._raise_if_aborted()
        if op == "mean":
            np.divide(out, self.size, out=out, casting="unsafe")
        return out

    def reads_pieces(self, nbytes: int, count: int) -> bool:
        """Whether :meth:`allreduce_pieces` of ``count`` pieces into ``nbytes`` reads them where they lie
        (without copying them into ``out`` first): the same on every rank."""
        segment = self._host_segment
        return self.size > 1 and segment is not None and segment.takes_pieces(nbytes, count)

    def _host_segment_takes(self, nbytes: int) -> bool:
        """Whether a collective reducing ``nbytes`` may go through the host segment: by the size of
        its slots, which the ranks agreed on, or, before they have, whatever the size (the first
        all-reduce or barrier sets it up, or finds that it cannot). Every rank decides alike,
        whatever its own options say."""
        if not self._host_segment_possible:
            return False
        return self._host_segment is None or self._host_segment.takes(nbytes)

    def _through_host_segment(self, call: ring.CollectiveCall, flat: np.ndarray, ufunc) -> bool:
        """All-reduces ``flat`` through the host segment (set up by the first call that may use one,
        :meth:`_host_segment_takes` said yes, so ``call`` was not announced); False, doing nothing
        but announce ``call``, when it cannot: then it goes by messages."""
        note = call.descriptor.SerializeToString()
        if self._host_segment is None:
            options = self.p2p.options
            wanted = host_allreduce.wanted_slot_bytes(options)
            self._host_segment = host_allreduce.HostAllreduce.agree(
                call, options.shared_memory_dir, wanted, options.single_copy
            )
            if self._host_segment is None:
                self._host_segment_possible = False
                return False
        if not self._host_segment_takes(flat.nbytes) or not host_allreduce.note_fits(note):
            self._host_segment.announce(note)
            return False
        differing = self._host_segment.allreduce(call, flat, ufunc, note, self._raise_if_aborted, _elsewhere)
        for src, theirs in differing.items():
            self._check(call.descriptor, src, peer_pb2.CollectiveDescriptor.FromString(theirs))
        self._raise_if_aborted()
        return True

    def _allreduce_compressed(self, array, op, ufunc, out, timeout, wire: str) -> np.ndarray:
        result = self._output_buffer(array, out)
        call = self._begin("allreduce", array.dtype, array.shape, reduce_op=op, timeout=timeout, compression=wire)
        with self._running(call):
            if self.size > 1:
                send16, recv16 = self._staging.get(result.size, wire_compression.WIRE_DTYPES[wire])
                ring.allreduce_compressed(call, result.reshape(-1), ufunc, send16, recv16)
                call.finish_sends()
        if op == "mean":
            np.divide(result, self.size, out=result, casting="unsafe")
        return result

    def reduce(self, array, root: int = 0, op: str = "sum", timeout: Optional[float] = None) -> Optional[np.ndarray]:
        """Reduces ``array`` over all ranks onto ``root``; returns the result on root, ``None`` elsewhere."""
        array = as_supported_array(array)
        ufunc = check_reduce_op(op, array.dtype)
        self._check_root(root)
        work = np.array(array, copy=True)
        call = self._begin("reduce", array.dtype, array.shape, reduce_op=op, root=root, timeout=timeout)
        with self._running(call):
            if self.size > 1:
                flat = work.reshape(-1)
                bounds = ring.even_bounds(flat.size, self.size)
                ring.reduce_scatter(call, flat, bounds, ufunc, owned=0)
                self._gather_segments(call, flat, bounds, root)
                call.finish_sends()
        if self.rank != root:
            return None
        if op == "mean":
            np.divide(work, self.size, out=work, casting="unsafe")
        return work

    def reduce_scatter(self, array, op: str = "sum", timeout: Optional[float] = None) -> np.ndarray:
        """Reduces ``array`` over all ranks and returns this rank's block of rows.

        The first dimension is split as evenly as possible, the first
        ``shape[0] % size`` ranks getting one row more (as ``np.array_split``).
        """
        array = as_supported_array(array)
        ufunc = check_reduce_op(op, array.dtype)
        if array.ndim == 0:
            raise UsageError("reduce_scatter needs an array with at least one dimension")
        work = np.array(array, copy=True)
        row_bounds = ring.even_bounds(array.shape[0], self.size)
        row_elems = int(np.prod(array.shape[1:], dtype=np.int64))
        bounds = [(a * row_elems, b * row_elems) for a, b in row_bounds]
        call = self._begin("reduce_scatter", array.dtype, array.shape, reduce_op=op, timeout=timeout)
        with self._running(call):
            if self.size > 1:
                ring.reduce_scatter(call, work.reshape(-1), bounds, ufunc, owned=0)
                call.finish_sends()
        start, stop = row_bounds[self.rank]
        result = work[start:stop].copy()
        if op == "mean":
            np.divide(result, self.size, out=result, casting="unsafe")
        return result

    def broadcast(
        self, array, root: int = 0, timeout: Optional[float] = None, out: Optional[np.ndarray] = None
    ) -> np.ndarray:
        """Returns root's ``array`` on every rank; other ranks pass an array of the same shape and
        dtype (its values are not read). ``out``: a C-contiguous array of that shape and dtype to
        receive into (``array`` itself: in place), returned.

        Example (on every rank; ranks other than 0 receive into a buffer never written before)::

            state = params if comm.rank == 0 else np.empty_like(params)
            comm.broadcast(state, root=0, out=state)
        """
        array = as_supported_array(array)
        self._check_root(root)
        result = self._receive_buffer(array, out) if self.rank != root else self._output_buffer(array, out)
        call = self._begin("broadcast", array.dtype, array.shape, root=root, timeout=timeout)
        with self._running(call):
            if self.size > 1:
                flat = result.reshape(-1)
                if result.nbytes <= _DIRECT_BROADCAST_BYTES or self.size == 2:
                    self._direct_broadcast(call, flat, root)
                else:
                    bounds = ring.even_bounds(flat.size, self.size)
                    self._scatter_segments(call, flat, bounds, root)
                    ring.allgather(call, flat, bounds, owned=0)
                call.finish_sends()
        return result

    def allgather(self, array, timeout: Optional[float] = None) -> np.ndarray:
        """Concatenates every rank's ``array`` along the first dimension, in rank order.

        The first dimension may differ between ranks; the others and the dtype must agree.
        """
        array = as_supported_array(array)
        if array.ndim == 0:
            raise UsageError("allgather needs an array with at least one dimension")
        call = self._begin("allgather", array.dtype, (-1,) + array.shape[1:], timeout=timeout)
        with self._running(call):
            rows = np.zeros(self.size, np.int64)
            rows[self.rank] = array.shape[0]
            if self.size > 1:
                ring.allgather(call, rows, ring.even_bounds(self.size, self.size), owned=0)
            row_elems = int(np.prod(array.shape[1:], dtype=np.int64))
            offsets = np.concatenate([[0], np.cumsum(rows)])
            result = np.empty((int(offsets[-1]),) + array.shape[1:], array.dtype)
            result[offsets[self.rank] : offsets[self.rank + 1]] = array
            if self.size > 1:
                bounds = [(int(offsets[i]) * row_elems, int(offsets[i + 1]) * row_elems) for i in range(self.size)]
                ring.allgather(call, result.reshape(-1), bounds, owned=0)
                call.finish_sends()
        return result

    def gather(self, array, root: int = 0, timeout: Optional[float] = None) -> Optional[np.ndarray]:
        """Concatenates every rank's ``array`` along the first dimension on ``root``; ``None`` elsewhere."""
        array = as_supported_array(array)
        self._check_root(root)
        if array.ndim == 0:
            raise UsageError("gather needs an array with at least one dimension")
        call = self._begin("gather", array.dtype, (-1,) + array.shape[1:], root=root, timeout=timeout)
        with self._running(call):
            if self.rank != root:
                call.send(array, root)
                call.finish_sends()
                return None
            requests = {src: call.recv_new(src) for src in range(self.size) if src != root}
            parts = [array if src == root else call.wait(requests[src]) for src in range(self.size)]
        return np.concatenate(parts, axis=0)

    def scatter(self, arrays: Optional[Sequence], root: int = 0, timeout: Optional[float] = None) -> np.ndarray:
        """Sends ``arrays[i]`` from ``root`` to rank ``i``; returns this rank's array.

        Only root's ``arrays`` is read (a list of ``size`` arrays); other ranks may pass ``None``.
        """
        self._check_root(root)
        if self.rank == root:
            if arrays is None or len(arrays) != self.size:
                got = "None" if arrays is None else f"{len(arrays)} arrays"
                raise UsageError(f"scatter on root {root} needs a list of {self.size} arrays, got {got}")
            arrays = [as_supported_array(a) for a in arrays]
        call = self._begin("scatter", None, (), root=root, timeout=timeout)
        with self._running(call):
            if self.rank == root:
                assert arrays is not None  # checked above
                for dst in range(self.size):
                    if dst != root:
                        call.send(arrays[dst], dst)
                call.finish_sends()
                return arrays[root].copy()
            return call.wait(call.recv_new(root))

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Returns once every rank has entered the barrier."""
        segment = self._host_segment_takes(0)
        call = self._begin("barrier", None, (), timeout=timeout, announce=not segment)
        with self._running(call):
            if self.size > 1 and not (segment and self._through_host_segment(call, _NOTHING, np.maximum)):
                flags = np.zeros(self.size, np.uint8)
                ring.allgather(call, flags, ring.even_bounds(self.size, self.size), owned=0)
                call.finish_sends()

    # ---- building blocks ------------------------------------------------------------------

    def _direct_broadcast(self, call: ring.CollectiveCall, flat: np.ndarray, root: int) -> None:
        if self.rank == root:
            for dst in range(self.size):
                if dst != root:
                    call.send(flat, dst)
        else:
            call.wait(call.recv_into(flat, root))

    def _scatter_segments(self, call: ring.CollectiveCall, flat: np.ndarray, bounds, root: int) -> None:
        if self.rank == root:
            for dst in range(self.size):
                if dst != root:
                    call.send(flat[bounds[dst][0] : bounds[dst][1]], dst)
        else:
            start, stop = bounds[self.rank]
            call.wait(call.recv_into(flat[start:stop], root))

    def _gather_segments(self, call: ring.CollectiveCall, flat: np.ndarray, bounds, root: int) -> None:
        if self.rank != root:
            start, stop = bounds[self.rank]
            call.send(flat[start:stop], root)
            return
        requests = [call.recv_into(flat[a:b], src) for src, (a, b) in enumerate(bounds) if src != root]
        for request in requests:
            call.wait(request)

    def _receive_buffer(self, array: np.ndarray, out: Optional[np.ndarray]) -> np.ndarray:
        """Where a rank receives what overwrites ``array``'s values: not a copy of them."""
        if out is None:
            return np.empty(array.shape, array.dtype)
        self._check_out(array, out)
        return out

    def _output_buffer(self, array: np.ndarray, out: Optional[np.ndarray]) -> np.ndarray:
        if out is None:
            return np.array(array, copy=True)
        self._check_out(array, out)
        if out is not array:
            np.copyto(out, array)
        return out

    @staticmethod
    def _check_out(array: np.ndarray, out) -> None:
        if (
            not isinstance(out, np.ndarray)
            or out.shape != array.shape
            or out.dtype != array.dtype
            or not out.flags.c_contiguous
        ):
            raise UsageError(
                f"out must be a C-contiguous array of shape {array.shape} and dtype {array.dtype}, "
                f"got {getattr(out, 'shape', None)} {getattr(out, 'dtype', type(out).__name__)}"
            )

    def _check_root(self, root: int) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise UsageError(f"root={root!r} is not a rank (0..{self.size - 1})")

    # ---- sequencing, mismatch detection, aborts -------------------------------------------

    def _begin(
        self,
        op: str,
        dtype,
        shape,
        reduce_op: str = "",
        root: int = -1,
        timeout=None,
        compression: str = "",
        announce: bool = True,
    ) -> ring.CollectiveCall:
        """Starts the next collective: its descriptor, deadline and checks of what peers sent early.

        ``announce``: tell the host segment's ranks (if any) what this rank does now; False for a
        collective that may go through the segment (it publishes its descriptor there)."""
        timeout = self.timeout_s if timeout is None else timeout
        if not timeout > 0:
            raise UsageError(f"timeout={timeout!r} must be a positive number of seconds")
        self._raise_if_aborted()
        descriptor = peer_pb2.CollectiveDescriptor()
        descriptor.CopyFrom(_descriptor_of(op, dtype, tuple(shape), reduce_op, root, compression))
        descriptor.sequence = self._sequence
        self._sequence += 1
        if announce and self._host_segment is not None:
            self._host_segment.announce(descriptor.SerializeToString())
        with self._lock:
            self._current = descriptor
            early = self._early.pop(descriptor.sequence, [])
        now = time.monotonic()
        call = ring.CollectiveCall(
            self.p2p,
            descriptor,
            now + timeout,
            warn_at=now + self.p2p.options.slow_warning_s,
            on_slow=lambda peers: self._log_slow(descriptor, peers),
        )
        self._active = call
        for src, theirs in early:
            self._check(descriptor, src, theirs)
        self._raise_if_aborted()
        return call

    def _log_slow(self, descriptor: peer_pb2.CollectiveDescriptor, peers: Set[int]) -> None:
        waiting = sorted(peers | self.p2p.mailbox.waiting_on(COLLECTIVE_CHANNEL))
        ids = self.p2p.worker_ids
        names = ", ".join(f"{r} ({ids[r]})" if r < len(ids) and ids[r] else str(r) for r in waiting)
        logger.warning(
            "collective #%d %s has waited %.0fs; still waiting for rank(s) %s",
            descriptor.sequence,
            _describe(descriptor),
            self.p2p.options.slow_warning_s,
            names,
        )

    def _running(self, call: ring.CollectiveCall):
        return _Running(self, call)

    def _observe(self, src: int, theirs: peer_pb2.CollectiveDescriptor) -> None:
        """Called from gRPC threads with the descriptor of every collective message."""
        with self._lock:
            current = self._current
            if current is None or theirs.sequence > current.sequence:
                self._early.setdefault(theirs.sequence, []).append((src, theirs))
                return
            if theirs.sequence < current.sequence:
                return
        self._check(current, src, theirs)

    def _check(self, mine: peer_pb2.CollectiveDescriptor, src: int, theirs: peer_pb2.CollectiveDescriptor) -> None:
        if mine == theirs:  # every message of a healthy job: one comparison in C
            return
        differs = _differences(mine, theirs)
        if differs:
            message = (
                f"collective #{mine.sequence}: rank {self.rank} called {_describe(mine)} but rank {src} "
                f"called {_describe(theirs)}{_as_number(mine, theirs)} (differs in {', '.join(differs)}); "
                "every rank must call the "
                "same collectives in the same order with the same arguments"
            )
            ranks = sorted({self.rank, src})
            self._abort(
                lambda: CollectiveMismatchError(f"rank {self.rank}: {message}", ranks=ranks, rank=self.rank),
                kind="mismatch",
                reason=message,
                ranks=ranks,
            )

    def _wake_host_segment(self) -> None:
        """A wait in the host segment looks at the news (an abort, a peer that failed or left)."""
        segment = self._host_segment
        if segment is not None:
            segment.wake()

    def _on_peer_failure(self, peer: int, reason: str, clean: bool) -> None:
        self._wake_host_segment()
        if clean:
            return  # a peer that shut down on purpose finished its collectives; pending receives from it fail alone
        message = f"{self.p2p.describe_peer(peer)} failed: {reason}"
        self._abort(
            lambda: PeerFailureError(f"rank {self.rank}: {message}", peer_rank=peer, rank=self.rank),
            kind="peer_failure",
            reason=message,
            ranks=[peer],
        )

    def _on_remote_abort(self, request: peer_pb2.AbortRequest) -> None:
        message = f"rank {self.rank}: rank {request.src_rank} reports: {request.reason}"
        ranks = list(request.ranks)
        make: Callable[[], CommunicationError]
        if request.kind == "peer_failure":
            peer = ranks[0] if ranks else None
            make = lambda: PeerFailureError(message, peer_rank=peer, rank=self.rank)  # noqa: E731
        elif request.kind == "mismatch":
            make = lambda: CollectiveMismatchError(message, ranks=ranks, rank=self.rank)  # noqa: E731
        elif request.kind == "timeout":
            make = lambda: CollectiveTimeoutError(message, waiting_for=ranks, rank=self.rank)  # noqa: E731
        else:
            make = lambda: CommunicationError(message, rank=self.rank)  # noqa: E731
        self._abort(make, kind=None, reason=request.reason, ranks=ranks, request=request)

    def _abort(
        self,
        make_error: Callable[[], CommunicationError],
        kind: Optional[str],
        reason: str,
        ranks,
        request: Optional[peer_pb2.AbortRequest] = None,
    ) -> None:
        """Fails the current and every later collective; tells the peers unless ``kind`` is None
        (an abort that came from a peer, which told everyone itself).

        The channel is failed while the lock is held: a stream thread that finds the
        communicator aborted (its own mismatch check calls here too) may deliver its message
        only after that, so no receive is handed a mismatched message instead of the abort.
        """
        with self._lock:
            if self._error_factory is not None:
                return
            self._error_factory = make_error
            self._abort_request = request or peer_pb2.AbortRequest(
                src_rank=self.rank,
                membership_version=self.p2p.membership_version,
                kind=kind,
                reason=reason,
                ranks=list(ranks),
            )
            self.p2p.mailbox.fail_channel(COLLECTIVE_CHANNEL, make_error)
        logger.error("collectives aborted: %s", reason)
        self._wake_host_segment()
        active = self._active
        if active is not None:  # a send stuck behind a dead or silent peer must not hold the caller
            for send in list(active.sends):
                send.abandon(make_error())
        if kind is not None:
            self.p2p.send_abort(kind, reason, ranks)

    def _raise_if_aborted(self) -> None:
        if self._error_factory is not None:
            raise self._error_factory()

    def _on_timeout(self, call: ring.CollectiveCall, error: CollectiveTimeoutError) -> CommunicationError:
        """Aborts every rank after a local deadline; returns the error to raise here."""
        if self._error_factory is not None:  # aborted already (maybe by a peer's timeout): keep that cause
            return self._error_factory()
        waiting = sorted(set(error.waiting_for) | self.p2p.mailbox.waiting_on(COLLECTIVE_CHANNEL))
        d = call.descriptor
        message = (
            f"collective #{d.sequence} {_describe(d)} did not complete within its deadline; "
            f"rank {self.rank} is still waiting for rank(s) {waiting}"
        )
        self._abort(
            lambda: CollectiveTimeoutError(f"rank {self.rank}: {message}", waiting_for=waiting, rank=self.rank),
            kind="timeout",
            reason=message,
            ranks=waiting,
        )
        return CollectiveTimeoutError(f"rank {self.rank}: {message}", waiting_for=waiting, rank=self.rank)

    def close(self, timeout: float = 5.0) -> None:
        """Ends the streams of this communicator; later calls raise CommunicatorClosedError."""
        self.p2p.close(timeout, abort=self._abort_request)
        if self._host_segment is not None:
            self._host_segment.close()


def _pieces_of(pieces: Sequence[np.ndarray], offsets: Sequence[int], out: np.ndarray) -> List[np.ndarray]:
    """The pieces as 1-D arrays, checked to fit ``out`` (see :meth:`Communicator.allreduce_pieces`).

    Raises:
        UsageError: they do not.
    """
    if not isinstance(out, np.ndarray) or out.ndim != 1 or not out.flags.c_contiguous or not out.dtype.isnative:
        raise UsageError("out must be a 1-D C-contiguous numpy array in the machine's byte order")
    as_supported_array(out[:0])  # raises UsageError for a dtype no collective supports
    if len(pieces) != len(offsets):
        raise UsageError(f"{len(pieces)} pieces but {len(offsets)} offsets")
    flats, end = [], 0
    for i, (piece, offset) in enumerate(zip(pieces, offsets)):
        if not isinstance(offset, (int, np.integer)):
            raise UsageError(f"offset {i} must be an integer, not {offset!r}")
        if not isinstance(piece, np.ndarray) or piece.dtype != out.dtype or not piece.flags.c_contiguous:
            raise UsageError(f"piece {i} must be a C-contiguous array of out's dtype {out.dtype}")
        if not end <= offset <= out.size - piece.size:
            raise UsageError(
                f"piece {i} ({piece.size} elements at {offset}) overlaps the one before it or ends beyond out "
                f"({out.size} elements)"
            )
        flats.append(piece.reshape(-1))
        end = offset + piece.size
    return flats


def _elsewhere(mine: bytes, theirs: bytes) -> bool:
    """Whether a rank whose current collective's descriptor is ``theirs`` is in another collective
    than ``mine``, and not in an earlier one (late, it may still come)."""
    if theirs == mine:
        return False
    try:
        sequence = peer_pb2.CollectiveDescriptor.FromString(theirs).sequence
    except DecodeError:  # not a descriptor: nothing to conclude; the deadline still holds
        return False
    return sequence >= peer_pb2.CollectiveDescriptor.FromString(mine).sequence


@functools.lru_cache(maxsize=256)
def _descriptor_of(
    op: str, dtype, shape: tuple, reduce_op: str, root: int, compression: str
) -> peer_pb2.CollectiveDescriptor:
    """A collective's descriptor without its sequence number; copied for each call (a third of the
    cost of building one)."""
    return peer_pb2.CollectiveDescriptor(
        op=op,
        dtype=dtype_name(dtype) if dtype is not None else "",
        shape=[int(x) for x in shape],
        reduce_op=reduce_op,
        root=root,
        compression=compression,
    )


class _Running:
    """Context for one collective: turns a timeout, or a peer that left or failed, into an abort of all ranks.

    A peer that closed its communicator on purpose does not abort the others by itself (it
    may simply have finished); only a collective that needed it does, here.
    """

    def __init__(self, communicator: Communicator, call: ring.CollectiveCall):
        self._communicator = communicator
        self._call = call

    def __enter__(self):
        return self._call

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and issubclass(exc_type, CollectiveTimeoutError):
            raise self._communicator._on_timeout(self._call, exc) from None
        if exc_type is not None and issubclass(exc_type, PeerFailureError):
            message, peer, rank = str(exc), exc.peer_rank, exc.rank
            self._communicator._abort(
                lambda: PeerFailureError(message, peer_rank=peer, rank=rank),
                kind="peer_failure",
                reason=message,
                ranks=[peer] if peer is not None else [],
            )
        return False
