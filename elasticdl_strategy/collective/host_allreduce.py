"""All-reduces among the ranks of one host through a host segment: one or two rounds, no messages.

The direct exchange (:mod:`.direct`) sends each rank's array to every peer: 2(N-1) lane messages
per rank, each a header, a copy and a wake. Through a host segment
(:mod:`elasticdl_strategy.transport.host_segment`) each rank copies its array into its own slot
once, publishes it with its collective's descriptor, waits until every rank has published, checks
that every descriptor equals its own, and reduces the N slots itself in rank order 0..N-1: every
rank does the same operations on the same values and gets the same bits, as with the direct
exchange (and the same bits as it). Where N slots are too much to read for every rank
(:func:`splits`), each rank reduces only its own part of them, in the same order, and puts it back
in its slot; after a second round of arrivals each copies the others' parts.

An all-reduce larger than a slot goes through the segment too where every rank may read every
other's memory (:mod:`elasticdl_strategy.transport.cross_memory`, found out when the segment is
set up): each rank publishes where its array lies instead of copying it, reduces its own part of
the arrays (:func:`parts`) in rank order 0..N-1, reading the others' straight out of their
processes, and after a second round reads the others' reduced parts the same way; a third round
keeps every array in place until nobody reads it. A rank that gives up before every rank's last
arrival (a wait or a read raised: the others may still read its array, which its caller may then
change, and a later call of its own may publish the arrival they wait for) says so in the segment,
so that a rank that read it fails its call too (:meth:`HostAllreduce._raise_if_abandoned`).
One copy per byte read instead of two (into a lane and out of it), no transport thread, no memory
beyond a few chunks of scratch, and nothing written into another process. The arrays of one call
need not even be one array (:meth:`HostAllreduce.allreduce_pieces`: a gradient bucket's tensors):
each rank then publishes a table of where its pieces lie, and the others read them piece by piece.

The segment is set up by the first all-reduce or barrier of a membership on one host, whatever its
size (:meth:`HostAllreduce.agree`, inside that collective, over the point-to-point messages that
stay the failure and control path): the ranks agree on the smallest slot size any asks for (none if
one asks for none; by default 256 KiB, or 4 MiB among 4 ranks or more where there is room: see
:func:`slot_sizes`), rank 0 creates it and sends its name to every rank; each maps it; the ranks
agree (a direct all-reduce of who could) to use it from then on, or never in this membership;
then whether each can read every other's memory (each reads a word another published, whose
value it knows). Which calls go through it follows from its slots' size and that agreement
alone, the same on every rank (:meth:`HostAllreduce.takes`).

While a rank waits for the others it watches what would end a wait for a message: the
communicator aborted (a peer failed, mismatched or timed out and said so), a peer that has not
arrived failed or left (its stream ended, its life mark, the coordinator), the deadline. Now and
then it reads every lane, so that a peer that called another collective is found out by what it
sent, and every missing peer's current note (:meth:`HostAllreduce.announce`, made by the
communicator at every collective), so that one found in another collective at the same or a
later place in the order is found out although it sends nothing (a broadcast's receiver).
Whoever learns of news in this process wakes the waiter (:meth:`HostAllreduce.wake`).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from elasticdl_strategy.collective import direct
from elasticdl_strategy.collective.p2p import SWEEP_S, PointToPoint
from elasticdl_strategy.collective.ring import CollectiveCall
from elasticdl_strategy.errors import CollectiveTimeoutError, CommunicatorClosedError, PeerFailureError
from elasticdl_strategy.transport import cross_memory, futex
from elasticdl_strategy.transport.host_segment import NONCE_BYTES, NOTE_BYTES, HostSegment
from elasticdl_strategy.transport.options import TransportOptions

logger = logging.getLogger(__name__)

_OFFER = struct.Struct(f"<B{NONCE_BYTES}s64s")  # name length (0: none), nonce, name
# See splits(): (N - 2) arrays of this many bytes in all take longer to read than a second round.
SPLIT_MIN_BYTES = 256 << 10
# A spinning wait looks this often for the arrivals between two checks for news (aborts, failed peers):
# a look takes a fraction of a microsecond, the checks several.
LOOKS_BETWEEN_CHECKS = 32
# See slot_sizes(). AUTO is larger than any size a rank may ask for: the smallest asked wins.
AUTO = 1 << 62
SMALL_SLOT_BYTES, LARGE_SLOT_BYTES, LARGE_SLOTS_FROM_RANKS = 256 << 10, 4 << 20, 4
LARGE_SEGMENT_BYTES = 128 << 20  # the most that large slots take: 2 * N of them
# A rank reducing its part reads the others' arrays in pieces of this size, each reduced while it
# is still in the core's cache.
READ_CHUNK_BYTES = 512 << 10
# Rank r's values of elements [a, b) of an all-reduce read in place: term(r, a, b, into) returns
# them, in ``into`` (b - a elements of scratch) or in a view of this rank's own memory.
Term = Callable[[int, int, int, np.ndarray], np.ndarray]
# In a slot, the table of an all-reduce of pieces: where the result lies, how many pieces, then
# (element offset, address, elements) for each (see HostAllreduce.allreduce_pieces).
_TABLE_HEADER_WORDS, _PIECE_WORDS = 2, 3


def possible(all_on_one_host: bool) -> bool:
    """Whether a membership may set up a host segment: one host, futexes (the same on every rank;
    what the ranks' options allow, :meth:`HostAllreduce.agree` finds out)."""
    return all_on_one_host and futex.AVAILABLE


def wanted_slot_bytes(options: TransportOptions) -> int:
    """The slot size this rank's options ask for in :meth:`HostAllreduce.agree`; 0: no segment;
    :data:`AUTO`: the default (:func:`slot_sizes`)."""
    if not options.shared_memory:
        return 0
    return AUTO if options.host_segment_bytes is None else options.host_segment_bytes


def slot_sizes(agreed: int, ranks: int) -> List[int]:
    """The slot sizes the segment's creator tries, in order, for the smallest size any rank asked
    for: that size, or by default (:data:`AUTO`) the larger slots where all-reduces of several MiB
    are faster in a segment than by the ring (it reduces them in parts, :func:`splits`; measured
    at N = 4 to 16, benchmarks/README.md), then the small ones where the directory has no room for
    them (a container's /dev/shm is 64 MiB by default). The larger slots shrink beyond 16 ranks, so
    that the segment stays within :data:`LARGE_SEGMENT_BYTES`.

    >>> slot_sizes(AUTO, 2), slot_sizes(AUTO, 8), slot_sizes(AUTO, 64), slot_sizes(AUTO, 256)
    ([262144], [4194304, 262144], [1048576, 262144], [262144])
    >>> slot_sizes(8192, 8)
    [8192]
    """
    if agreed != AUTO:
        return [agreed]
    large = min(LARGE_SLOT_BYTES, LARGE_SEGMENT_BYTES // (2 * ranks)) // mmap.PAGESIZE * mmap.PAGESIZE
    if ranks < LARGE_SLOTS_FROM_RANKS or large <= SMALL_SLOT_BYTES:
        return [SMALL_SLOT_BYTES]
    return [large, SMALL_SLOT_BYTES]


class HostAllreduce:
    """The host segment of one communicator and its all-reduces; see the module docstring.

    Built by :meth:`agree`. Used from the communicator's calling thread, one collective at a time;
    :meth:`wake` may be called from any thread.
    """

    def __init__(self, segment: HostSegment, pids: Optional[List[int]] = None):
        self._segment = segment
        self._pids = pids  # every rank's process id, where every rank may read every other's memory
        self._calls = 0  # all-reduces through the segment: their parity chooses the slots
        self._count = 0  # arrivals published (two for an all-reduce that splits, three for one in place)
        self._slots: Dict[tuple, Tuple[np.ndarray, ...]] = {}
        # By parity and rank: the word at the start of the slot where a rank publishes where its array lies.
        self._addresses = [[segment.slot(r, p, 8).cast("Q") for r in range(segment.ranks)] for p in (0, 1)]
        # By parity and rank: the slot as words, where an all-reduce of pieces publishes its table.
        self._tables = [
            [np.frombuffer(segment.slot(r, p, segment.slot_bytes), np.uint64) for r in range(segment.ranks)]
            for p in (0, 1)
        ]
        self._max_pieces = (segment.slot_bytes // 8 - _TABLE_HEADER_WORDS) // _PIECE_WORDS
        self._scratch: Optional[np.ndarray] = None
        self._closed = False

    @property
    def slot_bytes(self) -> int:
        return self._segment.slot_bytes

    @property
    def single_copy(self) -> bool:
        """Whether all-reduces larger than a slot go through the segment, read where they lie."""
        return self._pids is not None

    def takes(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` goes through the segment: one that fits a slot, or any
        where the ranks read each other's arrays (:attr:`single_copy`). The same on every rank."""
        return nbytes <= self._segment.slot_bytes or self._pids is not None

    def takes_pieces(self, nbytes: int, count: int) -> bool:
        """Whether an all-reduce of ``count`` pieces into an array of ``nbytes`` goes through the segment
        read where the pieces lie (:meth:`allreduce_pieces`): one larger than a slot, among ranks that
        read each other's memory, whose table of pieces fits a slot. The same on every rank."""
        return self._pids is not None and nbytes > self._segment.slot_bytes and count <= self._max_pieces

    @classmethod
    def agree(
        cls, call: CollectiveCall, directory: str, slot_bytes: int, single_copy: bool = True
    ) -> Optional["HostAllreduce"]:
        """Sets up a segment among all ranks of ``call``; every rank calls it within the same collective.
        ``slot_bytes``: the slots this rank's options ask for (:func:`wanted_slot_bytes`); the
        segment's are the smallest any rank asks for (by default, :func:`slot_sizes`; every rank
        reads what rank 0 made from the file), so that options differing between workers still
        give every rank the same segment and the same choice of path. ``single_copy``: whether this
        rank's options allow reading the others' arrays where they lie; that path is used only if
        every rank's do and every rank can (:func:`_readable_pids`).

        Returns:
            the segment's all-reduce on every rank, or None on every rank (some rank asked for
            none, or could not create or map it: another host or memory volume, no space).

        Raises:
            what the collective's messages raise (a peer failed, a mismatch, the deadline).
        """
        p2p = call.p2p
        smallest = np.array([slot_bytes], np.int64)
        direct.allreduce(call, smallest, np.minimum)
        if smallest[0] <= 0:
            return None
        segment = None
        try:
            if p2p.rank == 0:
                segment = _create(directory, p2p.size, slot_sizes(int(smallest[0]), p2p.size))
                offer = _encode_offer(segment)
                for dst in range(1, p2p.size):
                    call.send(offer, dst)
            else:
                offer = np.zeros(_OFFER.size, np.uint8)
                call.wait(call.recv_into(offer, 0))
                segment = _open_offer(directory, offer, p2p.rank, p2p.size)
            able = np.array([segment is not None], np.uint8)
            direct.allreduce(call, able, np.minimum)
            call.finish_sends()
        finally:  # all mapped it, gave up or failed: the memory goes with the last mapping
            if segment is not None:
                segment.unlink()
        if segment is None or not able[0]:
            if segment is not None:
                segment.close()
            return None
        return cls(segment, _readable_pids(call, single_copy))

    def allreduce(
        self,
        call: CollectiveCall,
        flat: np.ndarray,
        ufunc: Callable,
        note: bytes,
        healthy: Callable[[], None],
        differs: Callable[[bytes, bytes], bool],
    ) -> Dict[int, bytes]:
        """All-reduces the 1-D ``flat`` (a size the segment :meth:`takes`) in place over the segment.

        ``note`` describes the call (at most :data:`~.host_segment.NOTE_BYTES`; published with
        the slot, for the others to compare); ``healthy()`` raises when the communicator has
        aborted; ``differs(note, theirs)`` says whether a rank whose current note is ``theirs``
        does something else than this call (and not something earlier).

        Returns:
            ``{rank: its note}`` for ranks found doing something else (``flat`` is then not
            reduced); empty when all agree.

        Raises:
            PeerFailureError: a rank that has not arrived failed or left.
            CollectiveTimeoutError: not every rank arrived by the call's deadline.
            CommunicatorClosedError: the communicator was closed (before or during the call).
        """
        segment = self._segment
        in_place = flat.nbytes > segment.slot_bytes
        if in_place and self._pids is None:  # not one the segment takes
            raise ValueError(f"an all-reduce of {flat.nbytes} bytes does not go through this segment")
        parity = self._next_call(call)
        if in_place:
            self._addresses[parity][segment.rank][0] = flat.ctypes.data
        else:
            slots = self._slots_of(parity, flat)
            np.copyto(slots[segment.rank], flat)
        elsewhere = self._arrive(call, note, healthy, differs)
        if elsewhere:
            return elsewhere
        if in_place:
            term = self._array_term(call.p2p, flat, self._addresses_of(parity))
            self._reduce_in_place(call, flat, ufunc, parity, note, healthy, term)
        elif splits(flat.nbytes, segment.ranks):
            self._reduce_split(call, flat, ufunc, slots, note, healthy)
        else:
            self._reduce(flat, ufunc, slots, slice(None))
        return {}

    def allreduce_pieces(
        self,
        call: CollectiveCall,
        pieces: Sequence[np.ndarray],
        offsets: Sequence[int],
        flat: np.ndarray,
        ufunc: Callable,
        note: bytes,
        healthy: Callable[[], None],
        differs: Callable[[bytes, bytes], bool],
    ) -> Dict[int, bytes]:
        """All-reduces into the 1-D ``flat`` the array that ``pieces`` (1-D, ``flat``'s dtype) packed at
        element ``offsets`` would make, 0 between them, without packing them (a size and a number of
        pieces the segment :meth:`takes_pieces`): as the in-place all-reduce of :meth:`allreduce`,
        but each rank publishes a table of where its pieces lie instead of where its array does,
        and the others read each piece where it lies. Returns and raises as :meth:`allreduce`."""
        if not self.takes_pieces(flat.nbytes, len(pieces)):
            raise ValueError(
                f"an all-reduce of {len(pieces)} pieces into {flat.nbytes} bytes does not go through this segment"
            )
        parity = self._next_call(call)
        mine = Pieces(pieces, offsets)
        self._publish_table(parity, flat, mine)
        elsewhere = self._arrive(call, note, healthy, differs)
        if elsewhere:
            return elsewhere
        tables = [self._table_of(r, parity, flat.itemsize) for r in range(self._segment.ranks)]
        self._reduce_in_place(call, flat, ufunc, parity, note, healthy, self._pieces_term(call.p2p, mine, tables))
        return {}

    def _next_call(self, call: CollectiveCall) -> int:
        """Counts an all-reduce through the segment; returns its parity (which slots it uses).

        Raises:
            CommunicatorClosedError: the segment was closed.
        """
        if self._closed:
            raise _closed(call.p2p.rank)
        self._calls += 1
        return self._calls % 2

    def _publish_table(self, parity: int, flat: np.ndarray, mine: "Pieces") -> None:
        """Writes where ``flat`` and this rank's pieces lie into its slot of ``parity`` (published with
        its next arrival; read by the others before any rank can reach the next call of this parity)."""
        words = self._tables[parity][self._segment.rank]
        count = len(mine.offsets)
        rows = words[_TABLE_HEADER_WORDS : _TABLE_HEADER_WORDS + _PIECE_WORDS * count].reshape(count, _PIECE_WORDS)
        rows[:, 0], rows[:, 1], rows[:, 2] = mine.offsets, mine.addresses, mine.sizes
        words[1] = count
        words[0] = flat.ctypes.data

    def _table_of(self, rank: int, parity: int, itemsize: int) -> Optional["PieceTable"]:
        """The table ``rank`` published in its slot of ``parity`` (None for this rank's own)."""
        if rank == self._segment.rank:
            return None
        words = self._tables[parity][rank]
        count = min(int(words[1]), self._max_pieces)
        rows = words[_TABLE_HEADER_WORDS : _TABLE_HEADER_WORDS + _PIECE_WORDS * count].reshape(count, _PIECE_WORDS)
        rows = rows.astype(np.int64)  # a copy: the slot is written again two calls later
        return PieceTable(rows[:, 0], rows[:, 1], rows[:, 2], itemsize)

    def _arrive(
        self, call: CollectiveCall, note: bytes, healthy: Callable[[], None], differs: Callable[[bytes, bytes], bool]
    ) -> Dict[int, bytes]:
        """Publishes this rank's first arrival of a call (what it put in its slot, and ``note``) and waits
        for every rank's: ``{rank: its note}`` of ranks found doing something else, empty when every
        rank published ``note``."""
        segment = self._segment
        count = self._publish(note)
        if not segment.all_arrived(count):
            elsewhere = self._wait(call, count, healthy, lambda theirs: differs(note, theirs))
            if elsewhere:
                return elsewhere
        return {r: segment.note(r, count) for r in segment.not_noted(count, note)}

    def _publish(self, note: bytes) -> int:
        """Publishes this rank's next arrival (its slot and ``note``); returns its count."""
        self._count += 1
        self._segment.publish(self._count, note)
        return self._count

    @staticmethod
    def _reduce(flat: np.ndarray, ufunc: Callable, slots: Tuple[np.ndarray, ...], part: slice) -> None:
        """``flat[part]`` = the ``part`` of every rank's slot reduced in rank order 0..N-1."""
        out = flat[part]
        ufunc(slots[0][part], slots[1][part], out=out)
        for slot in slots[2:]:
            ufunc(out, slot[part], out=out)

    def _reduce_split(
        self,
        call: CollectiveCall,
        flat: np.ndarray,
        ufunc: Callable,
        slots: Tuple[np.ndarray, ...],
        note: bytes,
        healthy: Callable,
    ) -> None:
        """Each rank reduces its own part of the slots (:func:`parts`) and puts it back in its own
        slot, where no other rank reads (each reads its own part of every slot); once every rank
        has published its part, each copies the others'. Each element is reduced by the same
        operations in the same order as by :meth:`_reduce`: the same bits."""
        rank, ranks = self._segment.rank, self._segment.ranks
        bounds = parts(flat.size, ranks)
        mine = slice(bounds[rank], bounds[rank + 1])
        self._reduce(flat, ufunc, slots, mine)
        slots[rank][mine] = flat[mine]
        count = self._publish(note)
        self._wait(call, count, healthy, lambda theirs: False)  # all agreed on this call already
        for r in range(ranks):
            if r != rank:
                theirs = slice(bounds[r], bounds[r + 1])
                flat[theirs] = slots[r][theirs]

    def _reduce_in_place(
        self,
        call: CollectiveCall,
        flat: np.ndarray,
        ufunc: Callable,
        parity: int,
        note: bytes,
        healthy: Callable,
        term: Term,
    ) -> None:
        """Each rank reduces its own part (:func:`parts`) of every rank's values (``term``: read where
        they lie) into its own array ``flat``; once every rank has, each reads the others' parts of
        theirs into its own; once every rank has done that, nothing is read any more and each may
        return. The same operations in the same order as :meth:`_reduce`: the same bits."""
        p2p, rank, ranks = call.p2p, self._segment.rank, self._segment.ranks
        bounds = parts(flat.size, ranks)
        addresses = self._addresses_of(parity)
        last = self._count + 2  # this call's third arrival
        try:
            self._reduce_part(flat, ufunc, term, bounds[rank], bounds[rank + 1])
            self._wait(call, self._publish(note), healthy, lambda theirs: False)  # all agreed on this call already
            for r in range(ranks):
                if r != rank:
                    self._read(p2p, r, addresses[r] + bounds[r] * flat.itemsize, flat[bounds[r] : bounds[r + 1]])
            self._wait(call, self._publish(note), healthy, lambda theirs: False)
        except BaseException:
            if not self._segment.all_arrived(last):
                # Others may still read this rank's array, which its caller may now change or free,
                # and a later call of this rank may publish the arrival they wait for.
                self._segment.abandon(last)
            raise
        self._raise_if_abandoned(p2p, last, note)

    def _raise_if_abandoned(self, p2p: PointToPoint, count: int, note: bytes) -> None:
        """Raises PeerFailureError if a rank gave up the call whose last arrival is ``count``
        (:meth:`~.host_segment.HostSegment.abandon`), or published that arrival for another call: its
        array may have changed while this rank read it. Looked at once this rank's reads are done: a
        rank that gives up later changes its array only after saying so."""
        segment = self._segment
        moved_on = segment.not_noted(count, note)
        for r in range(segment.ranks):
            if r != segment.rank and (segment.abandoned(r) >= count or r in moved_on):
                raise PeerFailureError(
                    f"rank {p2p.rank}: {p2p.describe_peer(r)} gave up the all-reduce while this rank read "
                    "its array; the result is not used",
                    peer_rank=r,
                    rank=p2p.rank,
                )

    def _reduce_part(self, flat: np.ndarray, ufunc: Callable, term: Term, start: int, stop: int) -> None:
        """``flat[start:stop]`` = every rank's values of that part (``term``) reduced in rank order, a
        chunk at a time: each chunk read from the others is reduced while in cache. Only the last term
        is reduced straight into ``flat`` (this rank's own values may lie there)."""
        ranks = self._segment.ranks
        if self._scratch is None:
            self._scratch = np.empty((3, READ_CHUNK_BYTES), np.uint8)
        first, second, total = (row.view(flat.dtype) for row in self._scratch)
        pair = (first, second)
        step = first.size
        for a in range(start, stop, step):
            b = min(a + step, stop)
            out = flat[a:b]
            terms = [term(r, a, b, into[: b - a]) for r, into in enumerate(pair)]
            if ranks == 2:
                ufunc(terms[0], terms[1], out=out)
                continue
            ufunc(terms[0], terms[1], out=total[: b - a])
            for r in range(2, ranks):
                ufunc(total[: b - a], term(r, a, b, first[: b - a]), out=out if r == ranks - 1 else total[: b - a])

    def _array_term(self, p2p: PointToPoint, flat: np.ndarray, addresses: List[int]) -> Term:
        """Rank r's values of elements ``[a, b)`` of an in-place all-reduce: this rank's in ``flat``,
        another's read from its array (at the address it published) into ``into``."""
        rank, itemsize = self._segment.rank, flat.itemsize

        def term(r: int, a: int, b: int, into: np.ndarray) -> np.ndarray:
            if r == rank:
                return flat[a:b]
            self._read(p2p, r, addresses[r] + a * itemsize, into)
            return into

        return term

    def _pieces_term(self, p2p: PointToPoint, mine: "Pieces", tables: List[Optional["PieceTable"]]) -> Term:
        """Rank r's values of elements ``[a, b)`` of an all-reduce of pieces: this rank's from its
        pieces (a view where one piece holds them all), another's read from its pieces (by the table
        it published) into ``into``; 0 where no piece lies."""
        rank = self._segment.rank

        def term(r: int, a: int, b: int, into: np.ndarray) -> np.ndarray:
            if r == rank:
                return mine.values(a, b, into)
            reads = tables[r].reads(a, b, into)  # type: ignore[union-attr]
            if reads:
                self._read_pieces(p2p, r, reads)
            return into

        return term

    def _read(self, p2p: PointToPoint, peer: int, address: int, into: np.ndarray) -> None:
        """Copies ``into.nbytes`` bytes of ``peer``'s memory at ``address`` into ``into``.

        Raises:
            PeerFailureError: the kernel refused or found nothing there: ``peer`` ended or left.
        """
        self._read_pieces(p2p, peer, [(address, into)])

    def _read_pieces(self, p2p: PointToPoint, peer: int, reads: List[Tuple[int, np.ndarray]]) -> None:
        """For each ``(address, into)`` of ``reads``, copies ``into.nbytes`` bytes of ``peer``'s memory
        at ``address`` into ``into``; raises as :meth:`_read`."""
        assert self._pids is not None
        try:
            cross_memory.read_pieces(self._pids[peer], reads)
        except OSError as e:
            p2p.raise_if_failed([peer])
            raise PeerFailureError(
                f"rank {p2p.rank}: cannot read {p2p.describe_peer(peer)}'s array ({e.strerror}): "
                "its process ended or left the call",
                peer_rank=peer,
                rank=p2p.rank,
            ) from e

    def _addresses_of(self, parity: int) -> List[int]:
        """Where every rank's array of the in-place all-reduce of ``parity`` lies (published)."""
        return [words[0] for words in self._addresses[parity]]

    def announce(self, note: bytes) -> None:
        """Tells the ranks of the segment what this rank does now (every collective's descriptor).
        A descriptor too long for a note (:func:`note_fits`) is announced as none: the others then
        learn of that collective from its messages or their deadline."""
        self._segment.announce(note if note_fits(note) else b"")

    def wake(self) -> None:
        """Wakes this rank's wait, if any, to look at the news (an abort, a failed peer)."""
        self._segment.wake()

    def close(self) -> None:
        """Ends this rank's use of the segment: a wait in progress, and every later all-reduce, raise
        CommunicatorClosedError. The memory stays mapped until this object goes (a wait in another
        thread may still read it)."""
        self._closed = True
        self._segment.wake()

    def _slots_of(self, parity: int, like: np.ndarray) -> Tuple[np.ndarray, ...]:
        """Every rank's slot of ``parity``, by rank, as arrays of ``like``'s dtype and size (cached:
        a few calls' sizes repeat for the whole training)."""
        key = (parity, like.dtype, like.size)
        slots = self._slots.get(key)
        if slots is None:
            if len(self._slots) > 4096:
                self._slots.clear()
            segment = self._segment
            slots = tuple(np.frombuffer(segment.slot(r, parity, like.nbytes), like.dtype) for r in range(segment.ranks))
            self._slots[key] = slots
        return slots

    def _wait(
        self, call: CollectiveCall, count: int, healthy: Callable[[], None], elsewhere: Callable[[bytes], bool]
    ) -> Dict[int, bytes]:
        """Returns once every rank has published ``count`` (empty), or ``{rank: current note}`` of
        missing ranks that ``elsewhere(note)`` finds doing something else. Spins for ``spin_us``
        first (offering the core between looks with ``spin_yield``), then sleeps on the doorbell."""
        segment, p2p = self._segment, call.p2p
        now = time.monotonic()
        spin_until, sweep_at = now + p2p.options.spin_us * 1e-6, now + SWEEP_S
        while True:
            seen = segment.doorbell
            missing = segment.missing(count)
            if not missing:
                return {}
            if self._closed:
                raise _closed(p2p.rank)
            healthy()
            self._raise_if_failed(p2p, count, missing)
            now = time.monotonic()
            if now >= call.deadline:
                raise CollectiveTimeoutError(
                    f"rank {p2p.rank}: no contribution from rank(s) {missing} in the host segment",
                    waiting_for=missing,
                    rank=p2p.rank,
                )
            if now >= sweep_at:
                p2p.sweep_lanes()
                found = self._found_elsewhere(count, missing, elsewhere)
                if found:
                    return found
                call.warn_if_slow(now, missing)
                sweep_at = now + SWEEP_S
            if now < spin_until:
                self._look(count, p2p.options.spin_yield)
                continue
            segment.sleep(seen, count, min(call.deadline, sweep_at) - now)

    def _look(self, count: int, yielding: bool) -> None:
        """Looks for every rank's arrival ``count`` up to :data:`LOOKS_BETWEEN_CHECKS` times (offering
        the core between looks if ``yielding``): the checks of :meth:`_wait` cost more than a look,
        and the last rank's arrival is seen this much sooner."""
        all_arrived = self._segment.all_arrived
        for _ in range(LOOKS_BETWEEN_CHECKS):
            if all_arrived(count):
                return
            if yielding:
                os.sched_yield()

    # A rank that arrives after ``missing`` was read may finish the call at once and go on: announce
    # its next collective, or close and leave. So each check below reads the news first and the
    # arrivals after it, and blames only ranks that have still not arrived (x86-64 keeps loads in order,
    # and a rank publishes its arrival before it announces or leaves).

    def _raise_if_failed(self, p2p: PointToPoint, count: int, missing: List[int]) -> None:
        """Raises PeerFailureError for a rank of ``missing`` that failed or left without arriving."""
        try:
            p2p.raise_if_failed(missing)
        except PeerFailureError as e:
            if e.peer_rank in self._segment.missing(count):
                raise

    def _found_elsewhere(self, count: int, missing: List[int], elsewhere: Callable[[bytes], bool]) -> Dict[int, bytes]:
        """``{rank: current note}`` of the ``missing`` ranks that ``elsewhere(note)`` finds in another
        collective and that have still not arrived."""
        notes = {r: self._segment.current(r) for r in missing}
        late = self._segment.missing(count)
        return {r: note for r, note in notes.items() if r in late and note and elsewhere(note)}


def _spans(starts: np.ndarray, ends: np.ndarray, a: int, b: int) -> Iterator[Tuple[int, int, int]]:
    """``(piece, lo, hi)`` for each piece (of increasing, non-overlapping ``[starts, ends)``) holding
    elements of ``[a, b)``: it holds ``[lo, hi)`` of them."""
    i = int(np.searchsorted(ends, a, side="right"))
    while i < len(starts) and starts[i] < b:
        yield i, max(a, int(starts[i])), min(b, int(ends[i]))
        i += 1


def _zero_gaps(into: np.ndarray, a: int, spans: List[Tuple[int, int, int]]) -> None:
    """Zeroes the elements of ``into`` (elements ``[a, a + len(into))``) that no span holds."""
    at = a
    for _, lo, hi in spans:
        if lo > at:
            into[at - a : lo - a] = 0
        at = hi
    if at < a + into.size:
        into[at - a :] = 0


class Pieces:
    """This rank's pieces of an all-reduce of pieces: 1-D arrays at element offsets of the result."""

    def __init__(self, arrays: Sequence[np.ndarray], offsets: Sequence[int]):
        self.arrays = list(arrays)
        self.offsets = np.asarray(offsets, np.int64).reshape(-1)
        self.sizes = np.array([array.size for array in self.arrays], np.int64)
        self.addresses = np.array([array.ctypes.data for array in self.arrays], np.int64)
        self._ends = self.offsets + self.sizes

    def values(self, a: int, b: int, into: np.ndarray) -> np.ndarray:
        """Elements ``[a, b)`` of the packed array: a view of the one piece that holds them all, else
        copied into ``into`` (0 where no piece lies)."""
        spans = list(_spans(self.offsets, self._ends, a, b))
        if len(spans) == 1 and spans[0][1:] == (a, b):
            i = spans[0][0]
            return self.arrays[i][a - self.offsets[i] : b - self.offsets[i]]
        _zero_gaps(into, a, spans)
        for i, lo, hi in spans:
            into[lo - a : hi - a] = self.arrays[i][lo - self.offsets[i] : hi - self.offsets[i]]
        return into


class PieceTable:
    """Where another rank's pieces lie in its process, as it published them."""

    def __init__(self, offsets: np.ndarray, addresses: np.ndarray, sizes: np.ndarray, itemsize: int):
        self._offsets, self._addresses, self._itemsize = offsets, addresses, itemsize
        self._ends = offsets + sizes

    def reads(self, a: int, b: int, into: np.ndarray) -> List[Tuple[int, np.ndarray]]:
        """What to read (``(address, into's part)``) to have elements ``[a, b)`` in ``into``; zeroes
        the elements no piece holds."""
        spans = list(_spans(self._offsets, self._ends, a, b))
        _zero_gaps(into, a, spans)
        return [
            (int(self._addresses[i]) + (lo - int(self._offsets[i])) * self._itemsize, into[lo - a : hi - a])
            for i, lo, hi in spans
        ]


def _readable_pids(call: CollectiveCall, wanted: bool) -> Optional[List[int]]:
    """Every rank's process id if every rank wants to and can read every other's memory
    (:mod:`~elasticdl_strategy.transport.cross_memory`), else None; the same on every rank. Each
    publishes its pid, a random word and where that word lies, and reads the others' (two direct
    all-reduces among the ranks of ``call``): a pid that names another process here (another PID
    namespace, the reader itself included) does not hold that word there."""
    p2p = call.p2p
    pid = os.getpid()
    token = secrets.randbits(63)
    probe = np.array([token], np.int64)  # read by the others before the second all-reduce ends
    table = np.zeros((p2p.size, 4), np.int64)
    table[p2p.rank] = (int(wanted and cross_memory.AVAILABLE), pid, probe.ctypes.data, token)
    direct.allreduce(call, table.reshape(-1), np.add)
    able = bool(table[:, 0].all())
    seen = np.zeros(1, np.int64)
    for r in range(p2p.size):
        if not able or r == p2p.rank:
            continue
        try:
            cross_memory.read(int(table[r, 1]), int(table[r, 2]), seen)
        except OSError as e:
            logger.info("cannot read %s's memory (%s): large all-reduces go by messages", p2p.describe_peer(r), e)
            able = False
        else:
            able = int(seen[0]) == int(table[r, 3])
    agreed = np.array([able], np.uint8)
    direct.allreduce(call, agreed, np.minimum)
    del probe  # kept until here: every rank has read it
    return [int(p) for p in table[:, 1]] if agreed[0] else None


def splits(nbytes: int, ranks: int) -> bool:
    """Whether an all-reduce of ``nbytes`` among ``ranks`` is reduced in parts, one per rank (a
    second round, and every rank reads about 2 arrays instead of N): where (N - 2) arrays to read
    cost more than a round. Measured at N = 4 to 16 (benchmarks/README.md)."""
    return nbytes * (ranks - 2) >= SPLIT_MIN_BYTES


def parts(size: int, ranks: int) -> List[int]:
    """The bounds of the ranks' parts of ``size`` elements: rank r reduces ``[b[r], b[r + 1])``.

    >>> parts(10, 4)
    [0, 2, 5, 7, 10]
    """
    return [size * r // ranks for r in range(ranks + 1)]


def _closed(rank: int) -> CommunicatorClosedError:
    return CommunicatorClosedError(f"rank {rank}: the communicator is shut down", rank=rank)


def note_fits(note: bytes) -> bool:
    """Whether a collective's descriptor fits a note (a shape of very many dimensions does not)."""
    return len(note) <= NOTE_BYTES


def _create(directory: str, ranks: int, sizes: List[int]) -> Optional[HostSegment]:
    """A new segment with slots of the first of ``sizes`` there is room for; None if none."""
    for slot_bytes in sizes:
        try:
            return HostSegment.create(directory, 0, ranks, slot_bytes)
        except (OSError, ValueError) as e:
            logger.info("no host segment with slots of %d bytes (%s)", slot_bytes, e)
    logger.info("no host segment; small all-reduces go by messages")
    return None


def _encode_offer(segment: Optional[HostSegment]) -> np.ndarray:
    if segment is None:
        return np.frombuffer(_OFFER.pack(0, b"", b""), np.uint8).copy()
    name = segment.name.encode()
    return np.frombuffer(_OFFER.pack(len(name), segment.nonce, name), np.uint8).copy()


def _open_offer(directory: str, offer: np.ndarray, rank: int, ranks: int) -> Optional[HostSegment]:
    length, nonce, name = _OFFER.unpack(offer.tobytes())
    if not length:
        return None
    try:
        return HostSegment.open(directory, name[:length].decode("ascii", "replace"), nonce, rank, ranks)
    except (OSError, ValueError) as e:
        logger.info("cannot map rank 0's host segment (%s); small all-reduces go by messages", e)
        return None
