"""The receiving side of a ``Peer.Transfer`` stream: one routine, :func:`receive_messages`,
reading frames from a :class:`FrameSource` and handing messages to a :class:`StreamReceiver`.

A stream's frames come first from its gRPC call (:class:`GrpcFrames`) and, once
the sender says ``data_socket_attached``, from its direct data socket
(:class:`SocketFrames`). A message is a header frame followed by its payload:
inline in the header, in shared-memory slots named by ``shared_chunk`` frames,
or, for every other payload, read by the source (chunk frames on gRPC, raw
bytes on the data socket). What is done with the bytes (matching, copying,
reducing) belongs to the collective layer.

The routine runs in the server thread that serves the stream's call; on a data
socket, a thread waiting for one of the stream's messages reads too, one reader
at a time (:class:`SocketFrames`).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, Deque, Dict, Generator, Iterator, Optional, Protocol, Union

import numpy as np

from elasticdl_strategy.errors import DataSocketClosed, IncompleteStream
from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.data_socket import FrameSocket
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import ReceiveArena

logger = logging.getLogger(__name__)

# Payload bytes read from a data socket before they are handed on (reduced or copied). Measured
# (N = 2, alternating runs): 256 MiB 152-162 ms with 4 MiB pieces, 181-187 with 1 MiB, 198 with 256 KiB.
_SOCKET_PIECE = 1 << 22
# How long closing a stream's data socket waits for a thread still reading it.
_CLOSE_WAIT_S = 10.0
# A waiting thread reads the payloads up to this size itself (see _read_by_waiting_threads). Up to
# 1 MiB, N = 2 4 MiB all-reduces (2 MiB messages) took 2.3-2.9 ms instead of 1.1-1.5 through the
# hand-off to the stream's thread; sizes beyond this one gained nothing from reading in the caller.
WAITING_THREAD_READS_AT_MOST = 4 << 20
# The server thread of a quiet data socket looks again this often (it is woken for anything to read).
_SERVER_WAIT_SLICE_S = 1.0
# After a waiting thread read a stream's data socket, the server thread leaves the socket to such
# threads this long (what nobody waits for is still read by then: a sender never waits much longer).
_READERS_GRACE_S = 0.005

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


# Gives the writer of the one message a waiting thread awaits, for its header; None for any other.
Place = Callable[[peer_pb2.MessageHeader], Optional[MessageWriter]]


class StreamReceiver(Protocol):
    """Where one stream's messages go. A receiver that reads lanes also has
    ``attach_lane(lane: ReceiveLane)``: it then reads the messages the sender put
    in the lane of the stream's arena itself, and before it handles ``on_closed``;
    one with ``sender_died()`` is told (before ``on_closed``) when the sender of such
    a stream is seen dead through its life mark (:mod:`.life_marks`)."""

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

    Two kinds of thread read the socket, one at a time and a whole message at a time: the
    stream's server thread (:func:`receive_messages`, through :meth:`next_frame` and
    :meth:`read_payload`), and a thread waiting for one of the stream's messages
    (:meth:`read_while`), which then delivers the messages it reads itself instead of being
    woken by the server thread (one thread hand-off less per message). ``_reading`` is held by
    whichever reads: by the server thread from :meth:`next_frame` until its next call (or
    :meth:`close`), by a waiting thread within :meth:`read_while`. What a waiting thread
    reads and does not handle (a frame other than a message's header, a broken connection)
    it leaves in ``_left`` for the server thread, and wakes it.

    Who reads when: while waiting threads read the socket (one did within
    :data:`_READERS_GRACE_S`) it is theirs, and the server thread neither watches it nor, woken
    by a message anyway, reads it. Messages that came with one a waiting thread read (a peer a
    step ahead sent its next ones) stay in the read-ahead buffer, as they would in the kernel's,
    for the next waiting thread, which reads them the short way (``place`` of :meth:`read_while`).
    The socket becomes the server thread's again when the grace passes, or when it is handed over
    (:meth:`hand_to_server`; a thread letting go of it while a thread it turned away still waits,
    since that one sleeps on its receive), until a waiting thread that takes it afterwards reads a
    frame there.

    Args:
        data_socket: the connection.
        grpc_frames: the rest of the gRPC call, which must end without another frame.
    """

    def __init__(self, data_socket: FrameSocket, grpc_frames: Iterator[bytes]):
        self._socket = data_socket
        self._grpc_frames = grpc_frames
        self._scratch: Optional[memoryview] = None  # one piece of payload at a time, reused for every message
        self._reading = threading.Lock()
        self._server_reads = False  # the server thread holds _reading (only it reads and writes this)
        self._server_polls = False  # the server thread polls the socket (only it writes this)
        self._left: Deque[Union[bytes, Exception]] = collections.deque()  # changed under _reading
        self._closed = False
        self._reader: Optional[int] = None  # the thread in read_while, if any
        self._last_read = float("-inf")  # when a thread in read_while last stopped reading
        # Threads read_while turned away since the socket was last handed over, by ident: their
        # receive's waiting() (see _take_refused). Both dicts are changed under _refused_lock.
        self._refused: Dict[int, Callable[[], bool]] = {}
        self._refused_lock = threading.Lock()
        self._served: Dict[int, Callable[[], bool]] = {}  # those hand-overs were for, likewise
        # Hand-overs to the server thread (hand_to_server, _hand_over), and how many of them had been
        # made when the waiting thread that last read a frame took the socket: it is the server
        # thread's while more were made (a hand-over made during a read outlasts that read).
        self._hand_overs = 0
        self._hand_overs_read = 0
        self._hand_overs_seen = 0  # by the thread now in read_while, when it took the socket
        self._wake_lock = threading.Lock()  # the eventfds are written and closed under it
        self._wake_server = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_reader = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def next_frame(self) -> Optional[bytes]:
        self._stop_reading()
        while True:
            woken = False
            if not self._left:
                readable = self._wait_for_something()
                woken = _drain(self._wake_server)  # whatever woke it is looked at below
                if not (readable or woken or self._left):
                    continue  # a slice passed with nothing to look at
            self._reading.acquire()
            self._server_reads = True
            if self._left:
                item = self._left.popleft()
                if isinstance(item, Exception):
                    raise item
                return item
            # Woken by a message while waiting threads read here: they read the next ones too (a link
            # waking up after a step's computation), not the server thread, which would take them
            # first and hand them over. Handed the socket, it reads.
            if (self._handed() or not self._readers_active()) and self._socket.wait_readable(0):
                return self._socket.recv_frame()
            self._stop_reading()

    def _wait_for_something(self) -> bool:
        """Waits (up to a slice) until the server thread is woken or the socket has something to
        read; returns whether it has.

        While waiting threads read the socket (one did within :data:`_READERS_GRACE_S`), the
        server thread does not watch it: it would be woken by every message they read, and take
        CPU and the GIL from them, for nothing. They wake it for what they leave to it.
        """
        quiet = time.monotonic() - self._last_read
        if quiet < _READERS_GRACE_S and not self._handed():
            self._socket.wait_until_woken(_READERS_GRACE_S - quiet, self._wake_server)
            return False
        # Said before the socket's buffer is looked at: a waiting thread that leaves bytes there
        # after that look sees it, and wakes this thread (the socket's poll does not see them).
        self._server_polls = True
        try:
            return self._socket.wait_readable(_SERVER_WAIT_SLICE_S, self._wake_server)
        finally:
            self._server_polls = False

    def _readers_active(self) -> bool:
        """Whether the socket is the waiting threads' now: one read it within :data:`_READERS_GRACE_S`
        and it was not handed to the server thread since (:meth:`hand_to_server`, :meth:`_hand_over`)."""
        return not self._handed() and time.monotonic() - self._last_read < _READERS_GRACE_S

    def _handed(self) -> bool:
        """Whether the socket is the server thread's: handed over since a waiting thread that took it
        before read a frame."""
        return self._hand_overs > self._hand_overs_read

    def _hand_over(self, wake: bool = True) -> None:
        """Makes the socket the server thread's until a waiting thread that takes it later reads from
        it, and wakes the server thread (``wake``: unless it is the caller)."""
        self._hand_overs += 1
        if wake:
            self._wake(server=True)

    def read_payload(self, writer: MessageWriter, nbytes: int) -> None:
        for offset in range(0, nbytes, _SOCKET_PIECE):
            n = min(_SOCKET_PIECE, nbytes - offset)
            target = writer.target(offset, n)
            if target is None:
                scratch = self._scratch_of(n)
                self._socket.recv_into(scratch)
                writer.write(offset, scratch, borrowed=True)
                continue
            try:
                self._socket.recv_into(target)
            finally:
                writer.target_done()

    def _scratch_of(self, nbytes: int) -> memoryview:
        """``nbytes`` of memory to read a piece of payload into, reused for every message."""
        if self._scratch is None or len(self._scratch) < nbytes:
            self._scratch = np.empty(nbytes, np.uint8).data
        return self._scratch[:nbytes]

    def read_while(
        self,
        receiver: StreamReceiver,
        waiting: Callable[[], bool],
        deadline: float,
        spin_s: float = 0.0,
        spin_yield: bool = False,
        place: Optional[Place] = None,
    ) -> bool:
        """In a thread waiting for a message of this stream: unless another thread reads the socket,
        reads it and delivers to ``receiver`` every message that comes, while ``waiting()`` and
        until ``deadline`` (``time.monotonic()``); :meth:`wake_reader` makes it look at
        ``waiting()`` again at once. For the first ``spin_s`` seconds it looks at the socket again
        and again rather than sleep until something comes (a sleeping thread takes tens of
        microseconds to wake), offering its core to other threads between looks if ``spin_yield``.
        A message it began to read it reads to the end (at most
        :data:`WAITING_THREAD_READS_AT_MOST` bytes, so the deadline is overrun by one such
        transfer at most): a sender that stops in the middle of one holds it until
        :meth:`shutdown`, which the receiving side calls once that sender is declared failed.

        ``place(header)``, if given, reads the awaited message the short way: for that one header it
        returns the writer of its bytes, as ``receiver.on_header`` would (None for any other,
        changing nothing), and that message is not handed to ``receiver`` to find out whose it is.

        Returns:
            True once ``waiting()`` is false or the deadline passed; False, sooner, if another
            thread reads the socket, the stream ended or something came that the server thread
            handles: the message then comes the usual way.
        """
        if not self._take_socket(waiting):
            return False
        spin_until = time.monotonic() + spin_s
        try:
            while waiting():
                now = time.monotonic()
                remaining = deadline - now
                if self._closed or remaining <= 0:
                    return remaining <= 0
                wait = 0.0 if now < spin_until else remaining
                if not self._socket.wait_readable(wait, self._wake_reader):
                    if wait:
                        _drain(self._wake_reader)
                    elif spin_yield:
                        os.sched_yield()
                    continue
                if not self._read_message(receiver, place):
                    return False
            return True
        finally:
            self._let_go()

    def _take_socket(self, waiting: Callable[[], bool]) -> bool:
        """Makes a thread waiting for ``waiting()`` the socket's reader; False if another thread
        reads it (the reader hands it to the server thread when it lets go, if the waiting thread
        still waits) or something was left for the server thread, which comes first."""
        me = threading.get_ident()
        if not self._reading.acquire(blocking=False):
            # It waits on its receive now, not reading: the thread holding the socket hands it to the
            # server thread when it lets go. Then looks once more: that thread may have let go just now.
            with self._refused_lock:
                self._refused[me] = waiting
            if not self._reading.acquire(blocking=False):
                return False
        if me in self._refused:  # turned away before: only this thread adds itself
            with self._refused_lock:
                self._refused.pop(me, None)
        if self._left:  # what was left for the server thread comes first
            self._reading.release()
            return False
        self._reader = me
        self._hand_overs_seen = self._hand_overs
        return True

    def _let_go(self) -> None:
        """The waiting thread stops reading (:meth:`_take_socket` made it the reader)."""
        self._reader = None
        self._last_read = time.monotonic()
        left = bool(self._left)
        buffered = self._socket.buffered()
        self._reading.release()
        # Looked at after letting go, so that a thread turned away just before counts (it looked
        # once more after saying so). Those still waiting look again only now and then: the
        # server thread reads for them until a waiting thread reads here again.
        if self._take_refused() or self._still_served():
            self._hand_over()
        elif left or (buffered and self._server_polls):
            # What was left it reads; bytes left in the buffer it cannot see while it polls the
            # socket: woken, it looks again (it reads them only once the readers' grace has passed).
            self._wake(server=True)

    def _take_refused(self) -> bool:
        """Whether a thread turned away by :meth:`read_while` still waits for its message; forgets
        them all (a hand-over serves each once: one turned away again says so again), keeping those
        still waiting as the ones the hand-over is for (:meth:`_still_served`)."""
        if not self._refused:
            return False
        with self._refused_lock:
            refused, self._refused = self._refused, {}
            waiting = {thread: still for thread, still in refused.items() if still()}
            self._served.update(waiting)
        return bool(waiting)

    def _still_served(self) -> bool:
        """Whether a thread a hand-over was for still waits: a reader that took the socket since read
        its own message and ended that hand-over, so the one leaving hands it over again."""
        if not self._served:
            return False
        with self._refused_lock:
            self._served = {thread: still for thread, still in self._served.items() if still()}
            return bool(self._served)

    def hand_to_server(self) -> None:
        """Makes the server thread watch the socket again now, not after the waiting threads' grace
        (:data:`_READERS_GRACE_S`): for a thread about to block writing to any peer (the peer of
        this socket may be blocked writing to us, waiting for it to be read). A thread reading the
        socket meanwhile does not undo it; the next one to read a frame there does (the socket is the
        waiting threads' again, and the server thread waits out their grace)."""
        self._hand_over()

    def shutdown(self) -> None:
        """Ends the connection, from any thread (its sender failed): a thread reading a message that
        will never be finished returns, and the server thread ends the stream."""
        self._socket.shutdown()

    def wake_reader(self) -> None:
        """Makes a thread in :meth:`read_while` look at its ``waiting()`` now (any thread may call
        it; from the reading thread itself, which looks anyway, it does nothing)."""
        if self._reader != threading.get_ident():
            self._wake(server=False)

    def attached(self) -> FrameSource:
        raise ValueError("a data_socket_attached frame on the data socket")

    def end(self) -> None:
        if next(self._grpc_frames, None) is not None:
            raise ValueError("a frame on gRPC after the stream moved to its data socket")

    def close(self) -> None:
        self._closed = True
        self._socket.shutdown()  # a waiting thread in read_while sees the end and lets go of the socket
        # Whoever reads returns within a message now that the connection is shut; until then its
        # file descriptors must stay open (closed under it, their numbers could be reused).
        if not self._server_reads and not self._reading.acquire(timeout=_CLOSE_WAIT_S):
            logger.warning("a thread still reads a closed data socket after %gs; leaving it open", _CLOSE_WAIT_S)
            return
        self._server_reads = True
        self._socket.close()
        with self._wake_lock:
            os.close(self._wake_server)
            os.close(self._wake_reader)
            self._wake_server = self._wake_reader = -1
        self._stop_reading()

    def _read_message(self, receiver: StreamReceiver, place: Optional[Place] = None) -> bool:
        """Reads one frame in a waiting thread and delivers its message, to the writer ``place`` gives
        for its header or else to ``receiver``; False if it left the frame (or the connection's
        failure) to the server thread."""
        try:
            frame = self._socket.recv_frame()
            # A waiting thread reads here again: the socket is theirs, but for hand-overs since it took it.
            self._hand_overs_read = max(self._hand_overs_read, self._hand_overs_seen)
            control = None if frames.is_chunk(frame) else frames.decode_control(frame)
            if control is None or not _read_by_waiting_threads(control):
                self._left.append(frame)
                return False
            header = control.header
            deliver(self, receiver, header, place(header) if place is not None else None)
            return True
        except Exception as e:  # noqa: BLE001 - the server thread ends the stream with it, as if it had read it
            self._left.append(e)
            return False
        except BaseException:  # interrupted (Ctrl-C) in the middle of a frame: the stream cannot go on
            self._socket.shutdown()
            self._left.append(DataSocketClosed("a thread reading the data socket was interrupted mid-message"))
            raise

    def _stop_reading(self) -> None:
        if self._server_reads:
            self._server_reads = False
            self._reading.release()
            if self._take_refused():  # turned away while it held the socket: it reads for them
                self._hand_over(wake=False)

    def _wake(self, server: bool) -> None:
        with self._wake_lock:
            if not self._closed:
                os.eventfd_write(self._wake_server if server else self._wake_reader, 1)


def _read_by_waiting_threads(control: peer_pb2.Frame) -> bool:
    """Whether a waiting thread that read ``control`` reads its message too: a header whose payload
    is inline or on the socket, up to :data:`WAITING_THREAD_READS_AT_MOST` bytes. Larger ones are
    the stream thread's (a waiting thread would overrun its deadline by their whole transfer), as
    are payloads in shared-memory slots (their slots go back through the gRPC call) and every
    other frame."""
    if control.WhichOneof("kind") != "header":
        return False
    header = control.header
    return not header.HasField("shared_chunk") and header.nbytes <= WAITING_THREAD_READS_AT_MOST


def _drain(fd: int) -> bool:
    """Resets the eventfd ``fd``; returns whether it had been written."""
    try:
        return os.eventfd_read(fd) > 0
    except BlockingIOError:
        return False


def deliver(
    source: FrameSource,
    receiver: StreamReceiver,
    header: peer_pb2.MessageHeader,
    writer: Optional[MessageWriter] = None,
) -> None:
    """Hands a message whose header came to ``receiver`` (or to ``writer``, its writer if already
    known), its payload inline or read from ``source``."""
    if writer is None:
        writer = receiver.on_header(header)
    if header.inline_data:
        writer.write(0, memoryview(header.inline_data))
    elif header.nbytes:
        source.read_payload(writer, header.nbytes)
    writer.finish()


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
                attach_socket = getattr(receiver, "attach_socket", None)  # receivers that read sockets have it
                if attach_socket is not None:
                    attach_socket(source)
                continue
            if kind != "header":
                raise ValueError(f"a {kind} frame between messages")
            header = control.header
            if not header.HasField("shared_chunk"):
                deliver(source, receiver, header)
                continue
            writer = receiver.on_header(header)
            yield from _read_shared(source, arena, header, writer)
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
