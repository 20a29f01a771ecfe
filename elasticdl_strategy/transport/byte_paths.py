"""The three ways a message's bytes leave a worker on an :class:`~.outbound.OutboundStream`.

- :class:`GrpcPath`: frames and payload chunks are messages of the stream's
  ``Transfer`` call (a payload that fits in one chunk rides in one frame with
  its header).
- :class:`DataSocketPath`: after one ``data_socket_attached`` frame on gRPC,
  every frame goes on a direct TCP connection to the peer
  (:mod:`.data_socket`) and payloads follow their header raw.
- :class:`SharedMemoryPath`: payloads go through the slots of the sender's
  arena (:mod:`.shared_memory`), which a peer on the same host mapped; only a
  small frame per slot travels, on gRPC or on the data socket.

A stream settles on one path when its peer answers its hello; every path is
then used by one thread only, the stream's writer (gRPC's request iterator),
except the shared-memory slots that the peer hands back (see
:class:`SharedMemoryPath`).

A payload that fits in one chunk is one frame on gRPC; a larger one a header and its chunks:

>>> path = GrpcPath()
>>> header = peer_pb2.MessageHeader(sequence=1, nbytes=3)
>>> len(list(path.frames(header, memoryview(b"abc"), chunk_size=2)))
3
>>> len(list(path.frames(header, memoryview(b"abc"), chunk_size=4)))
1
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Deque, Iterable, Iterator, Optional, Protocol

from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.data_socket import FrameSocket
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import SendArena

# How often a writer waiting for a free slot wakes up to check that its stream still runs.
_IDLE_POLL_S = 1.0
# With both a data socket and a mapped arena, payloads up to this size still go raw on the socket:
# measured at 256 KiB and 1 MiB (N = 2 and 4), the slot round trip costs more than the kernel's copies.
RAW_ON_SOCKET_MAX_BYTES = 1 << 20


class BytePath(Protocol):
    """Where the bytes of a stream's messages go."""

    def frames(self, header: peer_pb2.MessageHeader, payload: memoryview, chunk_size: int) -> Iterator[bytes]:
        """The frames of one message to write on the gRPC call; writes the rest of it elsewhere.

        Stops early, having sent part of the message, only once the path was stopped.

        Raises:
            DataSocketClosed: the data socket broke.
        """
        ...

    def goodbye(self, goodbye: peer_pb2.Goodbye) -> Iterator[bytes]:
        """The stream's last frame, if it goes on the gRPC call (else written here).

        Raises:
            DataSocketClosed: the data socket broke.
        """
        ...


class SharedMemoryPath:
    """Payloads through the slots of the sender's arena, once the peer has mapped it.

    The writer thread takes free slots; the stream's reply reader thread hands
    back those the peer has read (:meth:`release`); :meth:`stop` wakes a writer
    waiting for one. ``bytes_sent`` belongs to the writer thread.
    """

    def __init__(self, arena: SendArena):
        self.arena = arena
        self.bytes_sent = 0
        self._free: Deque[int] = collections.deque(range(arena.slots))
        self._stopped = False
        self._cond = threading.Condition()

    def usable(self) -> bool:
        """Whether payloads may go through the slots: False, for good, where the shared-memory
        directory has no room for them (:meth:`.SendArena.back_slots`); they then go the way
        they would without an arena."""
        return self.arena.back_slots()

    def frames(self, header: peer_pb2.MessageHeader, payload: memoryview) -> Iterator[bytes]:
        """One frame per slot filled (the first is the message's header); waits for free slots."""
        piece = self.arena.slot_size
        for offset in range(0, len(payload), piece):
            slot = self._take()
            if slot is None:
                return
            nbytes = self.arena.fill(slot, payload[offset : offset + piece])
            self.bytes_sent += nbytes
            if offset == 0:
                header.shared_chunk.slot, header.shared_chunk.nbytes = slot, nbytes
                yield frames.encode_header(header)
            else:
                yield frames.encode_shared_chunk(slot, nbytes)

    def release(self, slots: Iterable[int]) -> None:
        """The peer has read ``slots``: they may be filled again."""
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def stop(self) -> None:
        """The stream ended: a writer waiting for a slot gives up."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _take(self) -> Optional[int]:
        with self._cond:
            while not self._free:
                if self._stopped:
                    return None
                self._cond.wait(_IDLE_POLL_S)
            return self._free.pop()  # the last handed back: its pages are warm


class GrpcPath:
    """Every frame on the gRPC call; payloads as chunk frames, or through ``shared`` memory."""

    def __init__(self, shared: Optional[SharedMemoryPath] = None):
        self.shared = shared

    def frames(self, header: peer_pb2.MessageHeader, payload: memoryview, chunk_size: int) -> Iterator[bytes]:
        if len(payload) and self.shared is not None and self.shared.usable():
            yield from self.shared.frames(header, payload)
        elif 0 < len(payload) <= chunk_size:
            yield frames.encode_whole_message(payload, header)
        else:
            yield frames.encode_header(header)
            for offset in range(0, len(payload), chunk_size):
                yield frames.encode_chunk(payload[offset : offset + chunk_size])

    def goodbye(self, goodbye: peer_pb2.Goodbye) -> Iterator[bytes]:
        yield frames.encode_goodbye(goodbye)


class DataSocketPath:
    """Every frame after the first message's ``data_socket_attached`` on the data socket; payloads
    raw after their header, or through ``shared`` memory when larger than
    :data:`RAW_ON_SOCKET_MAX_BYTES`."""

    def __init__(self, socket: FrameSocket, shared: Optional[SharedMemoryPath] = None):
        self.socket = socket
        self.shared = shared
        self._attached = False  # data_socket_attached was sent: every later frame goes on the socket

    def takes_now(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` may be written by :meth:`write_raw` (not waiting for the
        writer thread): once the stream moved to the socket, for payloads that go raw on it."""
        return self._attached and (self.shared is None or nbytes <= RAW_ON_SOCKET_MAX_BYTES)

    def write_raw(
        self, header: peer_pb2.MessageHeader, payload: memoryview, on_block: Optional[Callable[[], None]] = None
    ) -> None:
        """Writes a message, payload raw after its header, on the socket (see :meth:`takes_now`);
        ``on_block``: called before the write waits for room (:meth:`FrameSocket.send_frame`).

        Raises:
            DataSocketClosed: the data socket broke.
        """
        self.socket.send_frame(frames.encode_header(header), payload, on_block)

    def frames(self, header: peer_pb2.MessageHeader, payload: memoryview, chunk_size: int) -> Iterator[bytes]:
        if not self._attached:
            self._attached = True
            yield frames.encode_data_socket_attached()
        if self.shared is not None and len(payload) > RAW_ON_SOCKET_MAX_BYTES and self.shared.usable():
            for frame in self.shared.frames(header, payload):
                self.socket.send_frame(frame)
        else:
            self.write_raw(header, payload)

    def goodbye(self, goodbye: peer_pb2.Goodbye) -> Iterator[bytes]:
        if self._attached:
            self.socket.send_frame(frames.encode_goodbye(goodbye))
        else:
            yield frames.encode_goodbye(goodbye)
