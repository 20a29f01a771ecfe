"""Same-host fast path: a sender's arena of fixed-size slots in a shared-memory file.

When two workers share a host (or a memory volume), the bulk bytes of a
``Transfer`` stream need not cross gRPC and the loopback TCP stack. The sender
creates a :class:`SendArena` (a file in its shared-memory directory, mapped
into its address space) and offers it in the stream's hello. The receiver maps
the same file with :class:`ReceiveArena`; that only works when it sees the same
directory, and the random nonce at the start of the file proves it is the
sender's file and not one of the same name elsewhere. From then on the sender
copies each chunk into a free slot and sends a small ``SharedChunk`` frame
naming it; the receiver reduces or copies straight out of the slot and hands
it back. Every signal still travels on the gRPC stream, so a dead peer breaks
the stream and fails collectives exactly as without shared memory. Small
messages skip the frames and the transport's threads altogether: the arena
also holds a *lane* (:mod:`.lanes`) that the sending and the receiving
callers write and read themselves.

A sender also holds a life mark in the arena's first page (:mod:`.life_marks`),
which the receiver watches: a sender that dies is seen dead at once, tens of
milliseconds before its connections close.

The file's memory is taken (``posix_fallocate``) as its parts are first used
(the first page at once, the lane as far as its messages reach, all slots
before the first is filled): where the directory is full, the bytes take the
stream instead, where a write into the mapping would have killed the process.

Both sides unlink the file as soon as the receiver has mapped it (or refused
it), so the memory goes away with the last process that maps it, even when a
worker is killed. Only a sender killed in the milliseconds between creating an
arena and the receiver's answer leaves its file behind; creating an arena
removes such files once they are older than any live offer can be.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import re
import secrets
import time
import weakref
from typing import Callable, List, Optional, Tuple

import numpy as np

from elasticdl_strategy.transport import lanes, life_marks
from elasticdl_strategy.transport.lanes import ReceiveLane, SendLane
from elasticdl_strategy.transport.protos import peer_pb2

logger = logging.getLogger(__name__)

NAME_PREFIX = "edl-arena-"
_NAME_PATTERN = re.compile(r"edl-arena-[0-9]+-[0-9a-f]{16}")
_NONCE_BYTES = 16
# Slots start on a page boundary after the nonce, so chunks are aligned for any dtype.
_HEADER_BYTES = mmap.PAGESIZE
# In the first page, after the nonce and the lane's words (.lanes, up to byte 328).
_LIFE_MARK_OFFSET = 512
MAX_SLOTS = 1024
MAX_SLOT_SIZE = 64 << 20
# An arena still named after this long was abandoned: offers are answered (and the file
# unlinked) within seconds, and a receiver that maps one later just finds it gone and refuses.
STALE_AFTER_S = 600.0


def _arena_bytes(slots: int, slot_size: int, lane_bytes: int) -> int:
    """The file's size: the header page, the lane (if any), the slots."""
    return _HEADER_BYTES + lane_bytes + slots * slot_size


def unlink_quietly(path: str) -> None:
    """Removes the name ``path``. One already gone is fine; another failure is logged, not raised:
    a name left behind is removed by age (:func:`remove_stale_arenas`), while an exception would
    end the thread that unlinks (a stream's reply reader, which hands back the slots)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("cannot remove %s (%s); it is removed by age later", path, e.strerror)


def remove_stale_arenas(directory: str, now: Optional[float] = None, pattern: re.Pattern = _NAME_PATTERN) -> List[str]:
    """Removes arena files (names matching ``pattern``) in ``directory`` older than
    :data:`STALE_AFTER_S`; returns their names.

    Other processes' files are judged by age, not by pid: pods sharing a directory do
    not share pid namespaces.
    """
    now = time.time() if now is None else now
    removed: List[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not pattern.fullmatch(name):
            continue
        path = os.path.join(directory, name)
        try:
            if now - os.stat(path).st_mtime > STALE_AFTER_S:
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue  # unlinked meanwhile by its owner or its receiver
    if removed:
        logger.info("removed %d abandoned shared-memory arena(s) from %s", len(removed), directory)
    return removed


class SendArena:
    """The sender's side: creates and maps the file, fills slots.

    Which slots are free is tracked by the stream that owns the arena.

    Raises:
        OSError: the file cannot be created or mapped (no such directory, no
            space): callers fall back to sending the bytes over gRPC.
    """

    def __init__(self, directory: str, slots: int, slot_size: int, lane_bytes: int = 0):
        remove_stale_arenas(directory)
        self.slots = slots
        self.slot_size = slot_size
        self.lane_bytes = lane_bytes
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self._path = os.path.join(directory, self.name)
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        size = _arena_bytes(slots, slot_size, lane_bytes)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, _HEADER_BYTES)  # written now; the rest when first used (_Room)
            self._map = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            unlink_quietly(self._path)
            raise
        self._room = _Room(fd, self._path)
        self._map[:_NONCE_BYTES] = self.nonce
        self._first_slot = _HEADER_BYTES + lane_bytes
        self._slots_backed: Optional[bool] = None
        self._slots = [
            np.frombuffer(self._map, np.uint8, slot_size, self._first_slot + i * slot_size) for i in range(slots)
        ]
        self.lane = SendLane(self._map, _HEADER_BYTES, lane_bytes, self._room.take_lane) if lane_bytes else None
        self._mark: Optional[life_marks.HeldMark] = None
        if lane_bytes and life_marks.AVAILABLE:  # only a lane's reader maps the arena writable, to watch it
            try:
                self._mark = life_marks.hold(self._map, _LIFE_MARK_OFFSET)
            except (OSError, RuntimeError) as e:  # its peers then see its death when its connections close
                logger.warning("arena %s without a life mark: %s", self.name, e)
            else:  # an arena dropped before its stream began (or ended) lets go of it too
                weakref.finalize(self, self._mark.release)

    def release_mark(self) -> None:
        """Lets go of the life mark: the stream ends on purpose (before its goodbye) or has ended."""
        if self._mark is not None:
            self._mark.release()

    def offer(self) -> peer_pb2.SharedMemoryOffer:
        return peer_pb2.SharedMemoryOffer(
            name=self.name, nonce=self.nonce, slots=self.slots, slot_size=self.slot_size, lane_bytes=self.lane_bytes
        )

    def back_slots(self) -> bool:
        """Takes the memory of every slot (once); False when the directory has no room for it.

        Slots are filled only after this returned True: a write into a page of the file
        that the filesystem cannot provide kills the process (SIGBUS), where a full
        ``/dev/shm`` (64 MiB in a default Docker container) should only mean that the bytes
        take another path. All slots at once, because the receiver hands them back in
        batches of half the arena (:meth:`ReceiveArena.consumed`).
        """
        if self._slots_backed is None:
            self._slots_backed = self._room.take(self._first_slot, self.slots * self.slot_size)
        return self._slots_backed

    def fill(self, slot: int, data: memoryview) -> int:
        """Copies ``data`` (at most one slot) into ``slot``; returns its length."""
        n = len(data)
        np.copyto(self._slots[slot][:n], np.frombuffer(data, np.uint8))
        return n

    def unlink(self) -> None:
        """Removes the file's name; the mappings stay valid until both sides drop them."""
        unlink_quietly(self._path)


class _Room:
    """Takes the memory of parts of an arena's file (``posix_fallocate`` on its descriptor, kept open
    after the name is gone), and says once when there is none. Apart from the arena, so that its
    lane can hold it without a reference cycle."""

    def __init__(self, fd: int, path: str):
        self._fd = fd
        self._path = path
        self._short = False
        weakref.finalize(self, os.close, fd)

    def take_lane(self, start: int, end: int) -> bool:
        """Takes the memory of the lane's bytes ``[start, end)`` (:class:`.lanes.SendLane`)."""
        first = start - start % mmap.PAGESIZE
        return self.take(_HEADER_BYTES + first, end - first)

    def take(self, offset: int, nbytes: int) -> bool:
        """Takes the memory of the file's bytes ``[offset, offset + nbytes)``; False if there is no room."""
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as e:
            if not self._short:
                self._short = True
                logger.warning(
                    "no room for %d more bytes of shared memory in %s (%s): payloads to this peer take the "
                    "stream instead (a larger EDL_SHM_DIR or /dev/shm makes them faster)",
                    nbytes, os.path.dirname(self._path), e.strerror,
                )  # fmt: skip
            return False
        return True


class ReceiveArena:
    """The receiver's side: a read-only mapping of a sender's arena."""

    def __init__(self, mapping: mmap.mmap, slots: int, slot_size: int, lane_bytes: int = 0):
        self._map = mapping
        self.slots = slots
        self.slot_size = slot_size
        self._first_slot = _HEADER_BYTES + lane_bytes
        self.lane = ReceiveLane(mapping, _HEADER_BYTES, lane_bytes) if lane_bytes else None
        self._consumed: List[int] = []
        # Slots are handed back in batches of half the arena: one reply (a gRPC message, on the
        # receiving thread's path) per batch instead of per slot. It cannot stall the sender: a
        # sender out of slots has more than half of them filled, and consuming those completes a batch.
        self._batch = max(1, slots // 2)

    @classmethod
    def open(cls, directory: Optional[str], offer: peer_pb2.SharedMemoryOffer) -> Tuple[Optional["ReceiveArena"], str]:
        """Maps the offered arena; returns ``(arena, "")`` or ``(None, why not)``."""
        if directory is None:
            return None, "shared memory is disabled on the receiver"
        if not _NAME_PATTERN.fullmatch(offer.name):
            return None, f"invalid arena name {offer.name[:80]!r}"
        if not (0 < offer.slots <= MAX_SLOTS and 0 < offer.slot_size <= MAX_SLOT_SIZE and offer.slot_size % 64 == 0):
            return None, f"invalid arena geometry ({offer.slots} slots of {offer.slot_size} bytes)"
        lane_bytes = offer.lane_bytes
        if lane_bytes and not (lanes.MIN_BYTES <= lane_bytes <= lanes.MAX_BYTES and lane_bytes % 64 == 0):
            return None, f"invalid lane of {lane_bytes} bytes"
        path = os.path.join(directory, offer.name)
        size = _arena_bytes(offer.slots, offer.slot_size, lane_bytes)
        try:
            # A lane's reader writes back how far it has read: then the mapping is writable.
            fd = os.open(path, os.O_RDWR if lane_bytes else os.O_RDONLY)
        except OSError as e:
            return None, f"cannot open {path}: {e.strerror} (not the same host or memory volume)"
        try:
            if os.fstat(fd).st_size != size:
                return None, f"{path} has the wrong size"
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if lane_bytes else 0)
            mapping = mmap.mmap(fd, size, prot=prot)
        except OSError as e:
            return None, f"cannot map {path}: {e.strerror}"
        finally:
            os.close(fd)
        if not hmac.compare_digest(mapping[:_NONCE_BYTES], offer.nonce):
            mapping.close()
            return None, f"{path} is not the sender's arena (another host's file of the same name?)"
        unlink_quietly(path)
        return cls(mapping, offer.slots, offer.slot_size, lane_bytes), ""

    def view(self, chunk: peer_pb2.SharedChunk) -> memoryview:
        """The bytes of ``chunk``; valid until the slot is released.

        Raises:
            ValueError: the chunk names a slot or length outside the arena.
        """
        if not (chunk.slot < self.slots and chunk.nbytes <= self.slot_size):
            raise ValueError(f"shared chunk (slot {chunk.slot}, {chunk.nbytes} bytes) is outside the arena")
        start = self._first_slot + chunk.slot * self.slot_size
        return memoryview(self._map)[start : start + chunk.nbytes]

    def watch_sender(self, on_death: Callable[[], None]) -> Optional[life_marks.Watch]:
        """Calls ``on_death()`` as soon as the sender dies (:mod:`.life_marks`), until the watch is
        stopped; None where the arena cannot be watched (no lane: mapped read-only)."""
        if self.lane is None or not life_marks.AVAILABLE:
            return None
        try:
            return life_marks.watch(self._map, _LIFE_MARK_OFFSET, on_death)
        except RuntimeError as e:  # no thread to spare: its death is seen when its connection closes
            logger.warning("not watching the sender's life mark: %s", e)
            return None

    def consumed(self, slot: int) -> List[int]:
        """Records that ``slot`` was read; returns the slots to hand back now (empty until a batch is full)."""
        self._consumed.append(slot)
        if len(self._consumed) < self._batch:
            return []
        batch, self._consumed = self._consumed, []
        return batch

    def close(self) -> None:
        self.lane = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping goes with it
