"""Lanes: messages between two workers of one host, written and read by the callers' own threads.

The slots of a shared-memory arena (:mod:`.shared_memory`) carry large
payloads, but every piece still needs a frame from the sender's writer thread
to the receiver's reader thread, and the hand-offs between threads cost about
0.2 ms a message — most of a small all-reduce. A lane removes them: a ring of
records in the same arena file, one writer (the sending caller's thread,
inside ``isend``) and one reader (the thread that waits for a receive from
that peer), with no thread of the transport in between.

Layout (inside the arena's first page and the region after it)::

    control page: ... | written (u64, 64) | consumed (u64, 128) | doorbell (u32, 192) | sleepers (u32, 256)
                  | restarted at (u64, 320) | ...
    ring:          records, each 8-byte aligned:
                   size u32 | header length u32 | payload length u64 | header | pad | payload | pad
                   or WRAP (u32): the rest of the ring is skipped, the next record is at 0
                   (header length PIECE: no header, the payload continues the message before)

``written`` and ``consumed`` only grow (bytes, wraps included). A writer
that finds the ring empty (the reader consumed all) starts over at 0: it
stores its place in ``restarted at`` and moves to the next multiple of the
capacity; a reader at that place moves there too, and the writer counts the
reader as being there already (nothing is left to read before it). So a
sender and a reader taking turns use the ring's first pages only, which stay
in the cache and resident (a 2 MiB record there costs ~0.1 ms; in pages not
touched for a while, several times that). Unlike a WRAP record, the restart
takes no space in the ring, so nothing written after it must stay clear of
it.

The writer copies a record in, then stores ``written`` (x86-64 keeps stores in order, so
the record is visible first), then bumps the doorbell and wakes any reader
sleeping on it (:mod:`.futex`); the reader loads ``written``, reads the
records up to it and stores ``consumed``. A reader sleeps on the doorbell, not
on ``written``, because the reader's own process rings it too (a receive
completed by the stream instead, a stream that ended): it reads the doorbell,
then looks for what it waits for, then sleeps only if the doorbell still holds
what it read, so no ring between the look and the sleep is lost. The wake is a
system call (~8 µs, a fifth of a 4 KiB all-reduce when made on every message), so a
ring makes it only when ``sleepers`` (the reader's process counts its threads inside
the wait) is not zero: the ringer stores the doorbell, the reader stores ``sleepers``,
each then passes a full memory barrier before loading the other's word, so at least
one of them sees the other's store (the reader's kernel then finds the doorbell
changed and does not sleep, or the ringer finds a sleeper and wakes it).

A message whose record would be larger than a quarter of the ring goes in
pieces of :data:`PIECE_BYTES` (the first with the header), each published
and rung as soon as it is copied in, so the reader reduces or copies one
piece while the writer copies the next: a large message is one copy in and
one pass out, pipelined, by the callers alone. A message that does not fit
in the free space at once, pieces included (or is larger than three quarters
of the ring), is refused and travels the ordinary way, on the stream: a
sender never waits for a lane. Messages are matched by their sequence numbers, so a lane may
overtake the stream.

A lane only exists on an authenticated stream (its arena is offered in the
stream's hello, behind the job token) whose peer mapped the arena; the
stream stays open beside it, and its end (a dead peer, a goodbye) is what
fails or ends the receives, after the lane has been read to its end.
"""

from __future__ import annotations

import mmap
import struct
import threading
from typing import Callable, List, Optional, Tuple

import numpy as np

from elasticdl_strategy.transport import futex

# In the arena's first page, after its nonce; each word on a cache line of its own.
WRITTEN_OFFSET, CONSUMED_OFFSET, DOORBELL_OFFSET, SLEEPERS_OFFSET, RESTARTED_OFFSET = 64, 128, 192, 256, 320
_NEVER = 0xFFFFFFFFFFFFFFFF  # no restart yet (places are multiples of 8)
_PREFIX = struct.Struct("<IIQ")  # record size, header length, payload length
_WRAP_MARK = struct.Struct("<I")
_WRAP = 0xFFFFFFFF
_PIECE = 0xFFFFFFFF  # header length of a record that continues the message before it
MIN_BYTES, MAX_BYTES = 64 << 10, 64 << 20
# Messages larger than one record are cut into records of this much payload (at most a quarter of
# the ring): the reader uses each as it comes while the writer copies the next.
PIECE_BYTES = 512 << 10


def max_message_bytes(capacity: int) -> int:
    """The largest payload a lane of ``capacity`` bytes takes, in one record or in pieces."""
    return capacity * 3 // 4


def piece_bytes(capacity: int) -> int:
    """The payload of each record of a message in pieces."""
    return min(PIECE_BYTES, capacity // 8)


def _aligned(n: int) -> int:
    return (n + 7) & ~7


class _Lane:
    """The counters and ring of a lane in a mapped arena."""

    def __init__(self, mapping: mmap.mmap, ring_offset: int, capacity: int):
        self.capacity = capacity
        self._ring = np.frombuffer(mapping, np.uint8, capacity, ring_offset)
        self._bytes = self._ring.data  # copies and struct packing through a memoryview: 5x faster than numpy
        self._written = futex.word(mapping, WRITTEN_OFFSET, "Q")
        self._consumed = futex.word(mapping, CONSUMED_OFFSET, "Q")
        self._doorbell = futex.word(mapping, DOORBELL_OFFSET, "I")
        self._doorbell_address = np.frombuffer(mapping, np.uint32, 1, DOORBELL_OFFSET).ctypes.data
        self._sleepers = futex.word(mapping, SLEEPERS_OFFSET, "I")
        self._restarted = futex.word(mapping, RESTARTED_OFFSET, "Q")

    def _lap_after(self, place: int) -> int:
        return place - place % self.capacity + self.capacity

    @property
    def doorbell(self) -> int:
        return self._doorbell[0]

    def ring(self) -> None:
        """Changes the doorbell and wakes whoever sleeps on it (a reader waiting for a record, or for
        anything else: its receive completed another way, its stream ended); no system call
        when nobody sleeps.

        Two rings at once may store the same value; that still differs from what a sleeper read."""
        self._doorbell[0] = (self._doorbell[0] + 1) & 0xFFFFFFFF
        futex.memory_barrier()  # the doorbell's store before the load of sleepers (the module docstring)
        if self._sleepers[0]:
            futex.wake(self._doorbell_address)


class SendLane(_Lane):
    """The writing end: :meth:`try_send` from the thread that sends.

    ``back(start, end)``, if given, takes the memory of the ring's bytes ``[start, end)``
    before they are first written, False when there is no room; the ring is then used
    only as far as it reached (:meth:`.shared_memory.SendArena.back_slots` says why).
    """

    def __init__(
        self, mapping: mmap.mmap, ring_offset: int, capacity: int, back: Optional[Callable[[int, int], bool]] = None
    ):
        super().__init__(mapping, ring_offset, capacity)
        self._position = self._written[0]
        self._restarted[0] = self._restart = _NEVER  # before the arena is offered to the reader
        self._lock = threading.Lock()  # several threads may send to one peer
        self._back = back
        self._backed = 0 if back else capacity  # the ring's bytes [0, _backed) may be written

    def try_send(self, header: bytes, payload: memoryview) -> bool:
        """Writes one message and wakes the reader; False, writing nothing, when it does not fit now.

        A message whose record would exceed a quarter of the ring goes in pieces
        (:func:`piece_bytes` of payload each, the header in the first), each
        published as soon as it is written; all of them must fit at once, so the
        writer never waits for the reader. At most :func:`max_message_bytes`.
        """
        sizes = self._record_sizes(len(header), len(payload))
        if sizes is None:
            return False
        with self._lock:
            consumed = self._consumed[0]
            if consumed == self._restart:  # the reader moves on from there without reading
                consumed = self._lap_after(consumed)
            if consumed == self._position and self._position % self.capacity:  # empty: start over at 0
                self._restarted[0] = self._restart = self._position
                self._position = consumed = self._lap_after(self._position)
            end, furthest = self._extent(sizes)
            if end - consumed > self.capacity or not self._reach(furthest):
                return False
            if len(sizes) == 1:  # the usual case, without the pieces' slicing
                self._write_record(sizes[0], header, payload)
                self.ring()
                return True
            offset = 0
            for index, size in enumerate(sizes):
                first = index == 0
                length = size - _PREFIX.size - (_aligned(len(header)) if first else 0)
                length = min(length, len(payload) - offset)
                self._write_record(size, header if first else None, payload[offset : offset + length])
                offset += length
                self.ring()
        return True

    def _record_sizes(self, header_length: int, payload_length: int) -> Optional[List[int]]:
        """The records of a message, or None when it is too large for this lane."""
        header_end = _PREFIX.size + _aligned(header_length)
        if header_end + _aligned(payload_length) <= self.capacity // 4:
            return [header_end + _aligned(payload_length)]
        if payload_length > max_message_bytes(self.capacity) or header_end > self.capacity // 8:
            return None
        piece = piece_bytes(self.capacity)
        sizes = [header_end + piece]
        for start in range(piece, payload_length, piece):
            sizes.append(_PREFIX.size + _aligned(min(piece, payload_length - start)))
        return sizes

    def _extent(self, sizes: List[int]) -> Tuple[int, int]:
        """Where the writer would be after writing records of ``sizes``, wraps included, and the
        furthest byte of the ring they (and a WRAP mark) reach."""
        position, furthest = self._position, 0
        for size in sizes:
            start = position % self.capacity
            if size > self.capacity - start:
                furthest = max(furthest, start + _WRAP_MARK.size)
                position += self.capacity - start
                start = 0
            position += size
            furthest = max(furthest, start + size)
        return position, furthest

    def _reach(self, furthest: int) -> bool:
        """Whether the ring's bytes up to ``furthest`` may be written, taking their memory if need be."""
        if furthest <= self._backed:
            return True
        if self._back is None or not self._back(self._backed, furthest):
            self._back = None  # no room: the ring stays as far as it reached
            return False
        self._backed = furthest
        return True

    def _write_record(self, size: int, header: Optional[bytes], payload: memoryview) -> None:
        """Writes one record at the writer's place (after a WRAP if it does not fit before the end) and
        publishes it: ``header`` None marks a piece continuing the message before it."""
        ring = self._bytes
        start = self._position % self.capacity
        if size > self.capacity - start:
            _WRAP_MARK.pack_into(ring, start, _WRAP)
            self._position += self.capacity - start
            start = 0
        header_length = _PIECE if header is None else len(header)
        _PREFIX.pack_into(ring, start, size, header_length, len(payload))
        header_end = _PREFIX.size
        if header is not None:
            ring[start + _PREFIX.size : start + _PREFIX.size + len(header)] = header
            header_end += _aligned(len(header))
        if len(payload):
            ring[start + header_end : start + header_end + len(payload)] = payload.cast("B")
        self._position += size
        self._written[0] = self._position  # publish: after the record's bytes


class ReceiveLane(_Lane):
    """The reading end: :meth:`next_record`, then :meth:`release` once the record was used."""

    def __init__(self, mapping: mmap.mmap, ring_offset: int, capacity: int):
        super().__init__(mapping, ring_offset, capacity)
        self._position = self._consumed[0]
        self._sleepers_lock = threading.Lock()  # several threads of this process may wait at once

    def next_record(self) -> Optional[Tuple[Optional[memoryview], memoryview, int]]:
        """``(header, payload, end)`` of the next record, or None; both views are valid until
        :meth:`release`\\ ``(end)``. ``header`` is None for a piece continuing the message
        before it (the payload goes after that message's bytes so far).

        Raises:
            ValueError: the ring holds something that is not a record (a corrupt arena).
        """
        written = self._written[0]
        if written == self._position:
            return None
        if self._position == self._restarted[0]:  # loaded after written: the writer stores it first
            self._position = self._lap_after(self._position)
        start = self._position % self.capacity
        ring = self._bytes
        if _WRAP_MARK.unpack_from(ring, start)[0] == _WRAP:
            self._position += self.capacity - start
            start = 0
        size, header_length, payload_length = _PREFIX.unpack_from(ring, start)
        piece = header_length == _PIECE
        header_end = _PREFIX.size + (0 if piece else _aligned(header_length))
        if not (header_end + payload_length <= size <= self.capacity // 4 and self._position + size <= written):
            raise ValueError(f"a lane record of {size} bytes at {self._position} does not fit the lane")
        header = None if piece else ring[start + _PREFIX.size : start + _PREFIX.size + header_length]
        payload = ring[start + header_end : start + header_end + payload_length]
        return header, payload, self._position + size

    def release(self, end: int) -> None:
        """The record ending at ``end`` was used: the writer may reuse its space."""
        self._position = end
        self._consumed[0] = end

    def wait(self, seen: int, timeout: float) -> None:
        """Sleeps while the doorbell holds ``seen`` (read before looking for what is awaited),
        until it is rung or ``timeout`` passes."""
        self._count_sleeper(+1)  # its lock's release is the barrier before the kernel loads the doorbell
        try:
            futex.wait(self._doorbell_address, seen, timeout)
        finally:
            self._count_sleeper(-1)

    def _count_sleeper(self, change: int) -> None:
        with self._sleepers_lock:
            self._sleepers[0] = self._sleepers[0] + change
