"""The receiving side of a ``Peer.Transfer`` stream: one routine, :func:`receive_messages`,
reading frames from a :class:`FrameSource` and handing messages to a :class:`StreamReceiver`.

A stream's frames come first from its gRPC call (:class:`GrpcFrames`) and, once
the sender says ``data_socket_attached``, from its direct data socket
(:class:`SocketFrames`). A message is a header frame followed by its payload:
inline in the header, in shared-memory slots named by ``shared_chunk`` frames,
or, for every other payload, read by the source (chunk frames on gRPC, raw
bytes on the data socket). What is done with the bytes (matching, copying,
reducing) belongs to the collective layer.

All of it runs in the one server thread that serves the stream's call.
"""

from __future__ import annotations

from typing import Callable, Generator, Iterator, Optional, Protocol

import numpy as np

from elasticdl_strategy.errors import IncompleteStream
from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.data_socket import FrameSocket
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import ReceiveArena

# Payload bytes read from a data socket before they are handed on (reduced or copied). Measured
# (N = 2, alternating runs): 256 MiB 152-162 ms with 4 MiB pieces, 181-187 with 1 MiB, 198 with 256 KiB.
_SOCKET_PIECE = 1 << 22

Replies = Generator[peer_pb2.TransferReply, None, peer_pb2.Goodbye]
SlotReplies = Generator[peer_pb2.TransferReply, None, None]


class MessageWriter(Protocol):
    def write(self, offset: int, data: memoryview, borrowed: bool = False) -> None:
        """Stores ``data`` at byte ``offset`` of the message.

        ``borrowed`` data (a shared-memory slot) is reused once this returns:
        keep a copy, not the view.
        """

    def target(self, offset: int, nbytes: int) -> Optional[memoryview]:
        """A writable view where bytes ``offset .. offset + nbytes`` may be read directly
        (they then count as written), or ``None``: use :meth:`write`. Every view handed
        out must be followed by :meth:`target_done`."""

    def target_done(self) -> None:
        """Reading into the last view from :meth:`target` ended (filled, or the connection broke)."""

    def finish(self) -> None:
        """All bytes of the message were written."""


class StreamReceiver(Protocol):
    """Where one stream's messages go. A receiver that reads lanes also has
    ``attach_lane(lane: ReceiveLane)``: it then reads the messages the sender put
    in the lane of the stream's arena itself, and before it handles ``on_closed``."""

    def on_header(self, header: peer_pb2.MessageHeader) -> MessageWriter:
        """A message begins; returns where its bytes go."""

    def on_closed(self, error: Optional[str], goodbye: Optional[peer_pb2.Goodbye]) -> None:
        """The stream ended: after ``goodbye`` (``error`` None), or broken for the reason ``error``."""


class FrameSource(Protocol):
    """Where a stream's frames come from."""

    def next_frame(self) -> Optional[bytes]:
        """The next frame; None when the sender ended the stream.

        Raises:
            DataSocketClosed: the connection broke.
        """

    def read_payload(self, writer: MessageWriter, nbytes: int) -> None:
        """Reads the ``nbytes`` of payload that follow a header into ``writer``.

        Raises:
            IncompleteStream: the stream ended first.
            ValueError: a frame that is not payload.
        """

    def attached(self) -> "FrameSource":
        """The source of the stream's frames after ``data_socket_attached``.

        Raises:
            ValueError: this stream has no data socket to move to.
        """

    def end(self) -> None:
        """The goodbye came: checks that nothing follows it.

        Raises:
            ValueError: frames after the goodbye.
        """

    def close(self) -> None:
        """Releases what the source holds."""


class GrpcFrames:
    """The frames of the gRPC call; payloads follow their header as chunk frames.

    Args:
        frame_iterator: the call's request frames, after its hello.
        attach: returns the data socket the sender connected, when it says it moved there.
    """

    def __init__(self, frame_iterator: Iterator[bytes], attach: Callable[[], FrameSocket]):
        self._frames = frame_iterator
        self._attach = attach

    def next_frame(self) -> Optional[bytes]:
        return next(self._frames, None)

    def read_payload(self, writer: MessageWriter, nbytes: int) -> None:
        offset = 0
        while offset < nbytes:
            frame = next(self._frames, None)
            if frame is None:
                raise IncompleteStream("the stream ended in the middle of a message")
            if not frames.is_chunk(frame):
                kind = frames.decode_control(frame).WhichOneof("kind")
                raise ValueError(f"a {kind} frame inside a message's payload")
            payload = frames.chunk_payload(frame)
            writer.write(offset, payload)
            offset += len(payload)

    def attached(self) -> FrameSource:
        return SocketFrames(self._attach(), self._frames)

    def end(self) -> None:
        pass

    def close(self) -> None:
        pass


class SocketFrames:
    """The frames of a stream that moved to its data socket; payloads follow their header raw,
    read straight into the receive's buffer where it offers one.

    Args:
        data_socket: the connection.
        grpc_frames: the rest of the gRPC call, which must end without another frame.
    """

    def __init__(self, data_socket: FrameSocket, grpc_frames: Iterator[bytes]):
        self._socket = data_socket
        self._grpc_frames = grpc_frames
        self._scratch: Optional[memoryview] = None  # one piece of payload at a time, reused for every message

    def next_frame(self) -> Optional[bytes]:
        return self._socket.recv_frame()

    def read_payload(self, writer: MessageWriter, nbytes: int) -> None:
        piece = min(nbytes, _SOCKET_PIECE)
        if self._scratch is None or len(self._scratch) < piece:
            self._scratch = np.empty(piece, np.uint8).data
        scratch = self._scratch
        for offset in range(0, nbytes, len(scratch)):
            n = min(len(scratch), nbytes - offset)
            target = writer.target(offset, n)
            if target is None:
                self._socket.recv_into(scratch[:n])
                writer.write(offset, scratch[:n], borrowed=True)
                continue
            try:
                self._socket.recv_into(target)
            finally:
                writer.target_done()

    def attached(self) -> FrameSource:
        raise ValueError("a data_socket_attached frame on the data socket")

    def end(self) -> None:
        if next(self._grpc_frames, None) is not None:
            raise ValueError("a frame on gRPC after the stream moved to its data socket")

    def close(self) -> None:
        self._socket.close()


def receive_messages(source: FrameSource, receiver: StreamReceiver, arena: Optional[ReceiveArena]) -> Replies:
    """Delivers a stream's messages to ``receiver`` until the goodbye, which it returns; yields the
    replies that hand ``arena`` slots back to the sender.

    Raises:
        IncompleteStream: the stream ended without a goodbye.
        DataSocketClosed: the data socket broke.
        ValueError: a frame out of place (a bug or a corrupt stream).
    """
    try:
        while True:
            frame = source.next_frame()
            if frame is None:
                raise IncompleteStream("the stream ended without a goodbye")
            if frames.is_chunk(frame):
                whole = frames.split_whole_message(frame)
                if whole is None:
                    raise ValueError("a chunk frame without a message header")
                payload, header = whole
                writer = receiver.on_header(header)
                writer.write(0, payload)
                writer.finish()
                continue
            control = frames.decode_control(frame)
            kind = control.WhichOneof("kind")
            if kind == "goodbye":
                source.end()
                return control.goodbye
            if kind == "data_socket_attached":
                source = source.attached()
                continue
            if kind != "header":
                raise ValueError(f"a {kind} frame between messages")
            header = control.header
            writer = receiver.on_header(header)
            if header.inline_data:
                writer.write(0, memoryview(header.inline_data))
            elif header.HasField("shared_chunk"):
                yield from _read_shared(source, arena, header, writer)
            elif header.nbytes:
                source.read_payload(writer, header.nbytes)
            writer.finish()
    finally:
        source.close()


def _read_shared(
    source: FrameSource, arena: Optional[ReceiveArena], header: peer_pb2.MessageHeader, writer: MessageWriter
) -> SlotReplies:
    """Hands a payload that came through shared memory to ``writer``: its first slot named in the
    header, the others in ``shared_chunk`` frames; yields a reply whenever slots are due back."""
    if arena is None:
        raise ValueError("a shared-memory chunk on a stream without an arena")
    offset, chunk = 0, header.shared_chunk
    while True:
        with arena.view(chunk) as payload:
            writer.write(offset, payload, borrowed=True)
        released = arena.consumed(chunk.slot)
        if released:
            yield peer_pb2.TransferReply(released_slots=released)
        offset += chunk.nbytes
        if offset >= header.nbytes:
            return
        frame = source.next_frame()
        if frame is None:
            raise IncompleteStream("the stream ended in the middle of a message")
        control = frames.decode_control(frame)
        if control.WhichOneof("kind") != "shared_chunk":
            raise ValueError(f"a {control.WhichOneof('kind')} frame inside a message's payload")
        chunk = control.shared_chunk
