"""Host segments: one shared-memory file that every rank of a membership on one host maps.

Lanes (:mod:`.lanes`) carry one message between two callers without the transport's threads,
but a small all-reduce still takes a message to every peer and one from each. In a host segment
each rank has slots of its own that every other rank reads: a rank copies its array into its
slot, *publishes* (bumps its arrival count), and waits until every rank has arrived; then all
of them read the same N slots. What the ranks compute from them is up to the caller
(:mod:`elasticdl_strategy.collective.host_allreduce`); this module knows bytes and words only.

Layout (a page for the header, then a block per rank, then the slots)::

    header:   nonce (16 bytes) | ranks (u32, 16) | slot bytes (u32, 20)
    block r:  arrivals (u64, 0) | sleeping (u32, 64) | doorbell (u32, 128)
              | note p = 0, 1 (192 + 256·p) | current note (704) | abandoned (u64, 960)
    note:     version (u32) | length (u32) | bytes (up to NOTE_BYTES)
    slots:    after the blocks, page-aligned: rank r's slot of parity p is slot number 2r + p

Only rank r writes its block's arrivals, sleeping flag, notes and abandoned count; the others write
its doorbell. The *abandoned* count is the last arrival count of a call the rank gave up before every
rank reached it (:meth:`HostSegment.abandon`): ranks that read its memory during that call learn that
what they read may have changed under them.
A *note* is a few bytes a rank publishes with its slot (the caller's description of what it
put there, compared by the readers). Slots and notes come in two parities, so a rank can fill
the next call's slot while slower ranks still read the last one. The *current* note says what
a rank is doing now (:meth:`HostSegment.announce`), whether in the segment or not: ranks waiting
for it read it to tell a rank that is late from one that does something else. It is written
while others may read it, so its version is odd during a write (a sequence lock).

Waking: a rank that waits sets its sleeping flag, passes a full memory barrier, looks once more,
and sleeps on its own doorbell (:mod:`.futex`) only if what it waits for still has not come. A
publisher stores its arrival count, passes a barrier, and rings the doorbell of every rank whose
sleeping flag is set. Of the two stores and the two loads after the barriers at least one load
sees the other's store: either the waiter sees the arrival, or the publisher sees the sleeper and
changes its doorbell, so the kernel finds it changed or wakes it. Each ring writes a value no
ring wrote before (from the publisher's rank and count), so two rings at once cannot both store
the value a sleeper read. No system call is made while nobody sleeps.

The creator unlinks nothing by itself: once every rank has mapped the file (or given up), each
calls :meth:`HostSegment.unlink`, and the memory goes with the last process that maps it, killed
or not. Files left by a creator killed before that are removed by age, as arenas are
(:func:`.shared_memory.remove_stale_arenas`).
"""

from __future__ import annotations

import hmac
import mmap
import os
import re
import secrets
import struct
from typing import List, Tuple

import numpy as np

from elasticdl_strategy.transport import futex
from elasticdl_strategy.transport.futex import memory_barrier, word
from elasticdl_strategy.transport.shared_memory import remove_stale_arenas, unlink_quietly

NAME_PREFIX = "edl-segment-"
_NAME_PATTERN = re.compile(r"edl-segment-[0-9]+-[0-9a-f]{16}")
NONCE_BYTES = 16
_HEADER = struct.Struct("<II")  # ranks, slot bytes; after the nonce
_BLOCK_BYTES = 1024
_ARRIVALS, _SLEEPING, _DOORBELL, _NOTES, _CURRENT, _ABANDONED = 0, 64, 128, 192, 704, 960
_NOTE_STRIDE = 256
NOTE_BYTES = _NOTE_STRIDE - 8
_NOTE_PREFIX = struct.Struct("<II")  # version, length
_READ_ATTEMPTS = 100
MAX_RANKS = 256
MAX_SLOT_BYTES = 64 << 20
_WORDS = 0xFFFFFFFF


def _layout(ranks: int, slot_bytes: int) -> Tuple[int, int]:
    """(first slot's offset, file size)."""
    first_slot = mmap.PAGESIZE + -(-ranks * _BLOCK_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE
    return first_slot, first_slot + 2 * ranks * slot_bytes


def valid_name(name: str) -> bool:
    return _NAME_PATTERN.fullmatch(name) is not None


class HostSegment:
    """A mapped host segment; build it with :meth:`create` (one rank) or :meth:`open` (the others).

    ``rank`` is the caller's own rank: the block it writes.
    """

    def __init__(self, mapping: mmap.mmap, path: str, rank: int, ranks: int, slot_bytes: int):
        self._map = mapping
        self._path = path
        self.name = os.path.basename(path)
        self.nonce = bytes(mapping[:NONCE_BYTES])
        self.rank = rank
        self.ranks = ranks
        self.slot_bytes = slot_bytes
        self._first_slot, _ = _layout(ranks, slot_bytes)
        blocks = [mmap.PAGESIZE + r * _BLOCK_BYTES for r in range(ranks)]
        # One-element memoryviews: an aligned load or store of a Python int, faster than numpy's.
        self._arrivals = [word(mapping, b + _ARRIVALS, "Q") for b in blocks]
        self._abandoned = [word(mapping, b + _ABANDONED, "Q") for b in blocks]
        self._sleeping = [word(mapping, b + _SLEEPING, "I") for b in blocks]
        self._doorbells = [word(mapping, b + _DOORBELL, "I") for b in blocks]
        self._doorbell_addresses = [np.frombuffer(mapping, np.uint32, 1, b + _DOORBELL).ctypes.data for b in blocks]
        self._notes = [[b + _NOTES + p * _NOTE_STRIDE for p in (0, 1)] for b in blocks]
        # Per parity, each rank's note's length word and where its bytes start (not_noted).
        self._note_fields = [
            [(word(mapping, n[p] + 4, "I"), n[p] + _NOTE_PREFIX.size) for n in self._notes] for p in (0, 1)
        ]
        self._current = [b + _CURRENT for b in blocks]
        self._bytes = memoryview(mapping)
        self._others = [r for r in range(ranks) if r != rank]

    @classmethod
    def create(cls, directory: str, rank: int, ranks: int, slot_bytes: int) -> "HostSegment":
        """Creates and maps a new segment file in ``directory``.

        Raises:
            OSError: it cannot be created or mapped (no such directory, no space).
            ValueError: an impossible geometry (ranks, slot size).
        """
        if not (1 <= ranks <= MAX_RANKS and 0 < slot_bytes <= MAX_SLOT_BYTES and slot_bytes % mmap.PAGESIZE == 0):
            raise ValueError(f"invalid segment geometry ({ranks} ranks, slots of {slot_bytes} bytes)")
        remove_stale_arenas(directory, pattern=_NAME_PATTERN)
        path = os.path.join(directory, f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        _, size = _layout(ranks, slot_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Its memory taken now: on a full /dev/shm that raises here (ENOSPC), not SIGBUS at a
            # later write into a slot.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            unlink_quietly(path)
            raise
        finally:
            os.close(fd)
        mapping[:NONCE_BYTES] = secrets.token_bytes(NONCE_BYTES)
        _HEADER.pack_into(mapping, NONCE_BYTES, ranks, slot_bytes)
        return cls(mapping, path, rank, ranks, slot_bytes)

    @classmethod
    def open(cls, directory: str, name: str, nonce: bytes, rank: int, ranks: int) -> "HostSegment":
        """Maps the segment another rank created, checking that it is that rank's file (``nonce``).

        Raises:
            OSError: no such file here (another host or memory volume), or it cannot be mapped.
            ValueError: the name, size or nonce is not that of the offered segment.
        """
        if not valid_name(name):
            raise ValueError(f"invalid segment name {name[:80]!r}")
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR)
        try:
            header = os.pread(fd, NONCE_BYTES + _HEADER.size, 0)
            if len(header) < NONCE_BYTES + _HEADER.size or not hmac.compare_digest(header[:NONCE_BYTES], nonce):
                raise ValueError(f"{path} is not the offered segment (another host's file of that name?)")
            file_ranks, slot_bytes = _HEADER.unpack_from(header, NONCE_BYTES)
            _, size = _layout(file_ranks, slot_bytes)
            if file_ranks != ranks or not 0 <= rank < ranks or os.fstat(fd).st_size != size:
                raise ValueError(f"{path} does not fit a membership of {ranks} ranks")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(mapping, path, rank, ranks, slot_bytes)

    def unlink(self) -> None:
        """Removes the file's name (every rank maps it, or gave up); the mappings stay valid."""
        unlink_quietly(self._path)

    # ---- the caller's side -----------------------------------------------------------------

    def slot(self, rank: int, parity: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of ``rank``'s slot of ``parity`` (page-aligned).

        Raises:
            ValueError: ``nbytes`` exceeds a slot (it would reach into the next one).
        """
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a slot of {self.slot_bytes}")
        start = self._first_slot + (2 * rank + parity) * self.slot_bytes
        return self._bytes[start : start + nbytes]

    def publish(self, count: int, note: bytes) -> None:
        """Publishes ``note`` (in its note of parity ``count % 2``) and what this rank wrote into its
        slots: its arrival count becomes ``count``, then every sleeping rank is woken. Which slot a
        call uses is the caller's choice (:mod:`elasticdl_strategy.collective.host_allreduce`: by the
        call's number, since a call may publish twice)."""
        self._write_note(self._notes[self.rank][count % 2], 0, note)
        self._arrivals[self.rank][0] = count  # after the slot and the note: x86-64 keeps stores in order
        memory_barrier()  # the arrival's store before the loads of the sleeping flags (module docstring)
        ring = (count * self.ranks + self.rank) & _WORDS
        for r in self._others:
            if self._sleeping[r][0]:
                self._doorbells[r][0] = ring
                futex.wake(self._doorbell_addresses[r])

    def note(self, rank: int, count: int) -> bytes:
        """The note ``rank`` published with its arrival ``count``."""
        return self._read_note(self._notes[rank][count % 2])[1]

    def not_noted(self, count: int, note: bytes) -> List[int]:
        """The ranks that did not publish ``note`` with their arrival ``count`` (compared in place)."""
        parity, length, stored = count % 2, len(note), self._bytes
        differing = []
        for rank, (lengths, first) in enumerate(self._note_fields[parity]):
            if lengths[0] != length or stored[first : first + length] != note:
                differing.append(rank)
        return differing

    def announce(self, note: bytes) -> None:
        """Sets this rank's current note: what it does now."""
        start = self._current[self.rank]
        writing = (_NOTE_PREFIX.unpack_from(self._map, start)[0] + 1) & _WORDS | 1  # odd: being written
        struct.pack_into("<I", self._map, start, writing)
        self._write_note(start, (writing + 1) & _WORDS, note)

    def current(self, rank: int) -> bytes:
        """``rank``'s current note (empty: none yet, or it was being rewritten at every look)."""
        start = self._current[rank]
        for _ in range(_READ_ATTEMPTS):
            version, note = self._read_note(start)
            if version % 2 == 0 and _NOTE_PREFIX.unpack_from(self._map, start)[0] == version:
                return note
        return b""

    def _write_note(self, start: int, version: int, note: bytes) -> None:
        if len(note) > NOTE_BYTES:
            raise ValueError(f"a note of {len(note)} bytes exceeds {NOTE_BYTES}")
        self._bytes[start + _NOTE_PREFIX.size : start + _NOTE_PREFIX.size + len(note)] = note
        # The length, then the version last (x86-64 keeps stores in order): a reader that sees the
        # version sees the bytes and their length (one store of both would rely on memcpy's width).
        struct.pack_into("<I", self._map, start + 4, len(note))
        struct.pack_into("<I", self._map, start, version)

    def _read_note(self, start: int) -> Tuple[int, bytes]:
        version, length = _NOTE_PREFIX.unpack_from(self._map, start)
        first = start + _NOTE_PREFIX.size
        return version, bytes(self._bytes[first : first + min(length, NOTE_BYTES)])

    def arrivals(self, rank: int) -> int:
        return self._arrivals[rank][0]

    def abandon(self, count: int) -> None:
        """Says that this rank gave up the call whose last arrival is ``count`` (published or not): it
        no longer keeps what the others read during that call (its array) as it was."""
        self._abandoned[self.rank][0] = count
        memory_barrier()

    def abandoned(self, rank: int) -> int:
        """The arrival count of the last call ``rank`` gave up (0: none)."""
        return self._abandoned[rank][0]

    def missing(self, count: int) -> List[int]:
        """The ranks whose arrival count is still below ``count``."""
        return [r for r, a in enumerate(self._arrivals) if a[0] < count]

    def all_arrived(self, count: int) -> bool:
        """Whether every rank's arrival count has reached ``count`` (:meth:`missing` is empty),
        without building a list: a waiting rank asks it again and again."""
        for arrivals in self._arrivals:
            if arrivals[0] < count:
                return False
        return True

    @property
    def doorbell(self) -> int:
        """This rank's doorbell: read it before looking for what is awaited, then :meth:`sleep`."""
        return self._doorbells[self.rank][0]

    def sleep(self, seen: int, count: int, timeout: float) -> None:
        """Sleeps while this rank's doorbell holds ``seen`` and some rank has not reached ``count``,
        at most ``timeout`` seconds; returns early on a wake (look again)."""
        flag = self._sleeping[self.rank]
        flag[0] = 1
        try:
            memory_barrier()  # the flag's store before the arrivals' loads (module docstring)
            if self.missing(count):
                futex.wait(self._doorbell_addresses[self.rank], seen, timeout)
        finally:
            flag[0] = 0

    def wake(self) -> None:
        """Wakes this rank if it sleeps in :meth:`sleep` (another thread of its process has news)."""
        doorbell = self._doorbells[self.rank]
        doorbell[0] = doorbell[0] ^ 0x80000000
        futex.wake(self._doorbell_addresses[self.rank])

    def close(self) -> None:
        """Unmaps the segment (views still held keep it mapped until they go)."""
        self._arrivals = self._sleeping = self._doorbells = self._abandoned = []
        self._note_fields = [[], []]
        try:
            self._bytes.release()
            self._map.close()
        except BufferError:
            pass  # a slot's view is still referenced somewhere; the mapping goes with it
