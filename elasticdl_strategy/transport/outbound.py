"""The sending side of a ``Peer.Transfer`` stream: :class:`OutboundStream`.

A sender keeps one stream open per peer for the life of a communicator.
Messages are queued without blocking and written in order by gRPC's
request-iterator thread. The stream's hello may offer the peer a shared-memory
arena and ask it for a direct data socket; the peer's answer settles the
stream's :mod:`byte path <.byte_paths>` before the first message is written.
Small messages to a peer that mapped the arena skip the queue: the caller
writes them into the arena's lane itself (:meth:`OutboundStream.try_lane`);
so do messages on a stream that moved to its data socket, which the caller
writes on the socket itself when nothing is queued (:meth:`OutboundStream.try_socket`).
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from concurrent import futures
from typing import Callable, Deque, Iterator, Optional

import grpc

from elasticdl_strategy.errors import CommunicatorClosedError, DataSocketClosed, PeerFailureError
from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.auth import call_metadata
from elasticdl_strategy.transport.byte_paths import BytePath, DataSocketPath, GrpcPath, SharedMemoryPath
from elasticdl_strategy.transport.data_socket import FrameSocket, connect
from elasticdl_strategy.transport.lanes import SendLane
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.peer_link import TRANSFER_METHOD
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import SendArena

logger = logging.getLogger(__name__)

# How often idle waits wake up to check for shutdown.
_IDLE_POLL_S = 1.0
# How long the first message waits for the peer to answer a shared-memory offer or data socket request.
_ANSWER_TIMEOUT_S = 10.0
# At most this long to connect a data socket (and have its ticket accepted) before staying on gRPC:
# a firewalled data port must not hold up every stream of every membership for long.
_DATA_CONNECT_TIMEOUT_S = 3.0


def settle(future: futures.Future, error: Optional[BaseException] = None) -> None:
    """Completes ``future`` (with ``error`` if given) unless another thread already did."""
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except futures.InvalidStateError:
        pass


class OutgoingMessage:
    """One message queued on an :class:`OutboundStream`.

    ``future`` completes when the last frame has been handed to the
    transport; the payload memory must stay unchanged until then.
    """

    __slots__ = ("header", "payload", "chunk_size", "future")

    def __init__(self, header: peer_pb2.MessageHeader, payload: memoryview, chunk_size: int):
        self.header = header
        self.payload = payload
        self.chunk_size = chunk_size
        self.future: futures.Future = futures.Future()


# ``_in_flight`` while a caller writes a message itself (OutboundStream.try_socket): a message of
# no one's, whose future nobody waits on (a Future per direct write cost ~1-2 us).
_A_CALLER_WRITES = OutgoingMessage(peer_pb2.MessageHeader(), memoryview(b""), 0)


class StreamState(enum.Enum):
    """Where an :class:`OutboundStream` is in its life.

    The transitions, all made by ``OutboundStream._move``::

        OPEN ──close()──> CLOSING ──the call ended──> CLOSED
          │                  │
          └──────broken──────┴──> BROKEN

    "Broken" is the peer or the connection failing, or :meth:`OutboundStream.fail`;
    only a stream broken while OPEN reports it (``on_broken``).
    """

    OPEN = "open"  # messages are accepted and written
    CLOSING = "closing"  # queued messages are flushed, then the goodbye; no new ones
    CLOSED = "closed"  # the goodbye was sent and the call ended
    BROKEN = "broken"  # every unsent message and every later one fails with the first reason


_TRANSITIONS = {
    StreamState.OPEN: {StreamState.CLOSING, StreamState.BROKEN},
    StreamState.CLOSING: {StreamState.CLOSED, StreamState.BROKEN},
    StreamState.CLOSED: set(),
    StreamState.BROKEN: set(),
}


class OutboundStream:
    """The long-lived ``Transfer`` stream from this worker to one peer.

    Threads and what they own: the callers of :meth:`submit`, :meth:`try_lane`,
    :meth:`try_socket` (which writes while it holds ``_in_flight``), :meth:`close` and
    :meth:`fail`; the writer (gRPC's request iterator, :meth:`_frames`) takes queued
    messages and writes them on the settled path, never while a caller writes;
    the reply reader (only when the hello offers an arena or asks for a data
    socket) reads the peer's answer, settles ``_path`` and hands arena slots
    back; gRPC's callback thread reports the call's end. ``_state``,
    ``_reason``, ``_queue``, ``_in_flight`` and ``_path`` change only under
    ``_cond``; ``_path`` and ``_lane`` are set once; ``bytes_sent`` is changed by
    whoever writes (the writer, or a caller in :meth:`try_socket`).

    Args:
        channel: channel to the peer.
        hello: first frame of the stream, identifying the sender.
        token: job token sent as call metadata.
        peer_rank: rank of the receiving peer (for error messages).
        on_broken: called once, from a gRPC thread, with a reason when the
            stream ends other than through :meth:`close`.
        arena: a shared-memory arena to offer the peer; payloads go through
            it once the peer has mapped it, over gRPC until then or if it refuses.
        data_host: the peer's host, to ask for a direct data socket for the
            stream's frames; ``None`` keeps every frame on gRPC.
        options: timeouts and limits of the data socket.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        hello: peer_pb2.StreamHello,
        token: str,
        peer_rank: int,
        on_broken: Callable[[str], None],
        arena: Optional[SendArena] = None,
        data_host: Optional[str] = None,
        options: Optional[TransportOptions] = None,
    ):
        self._peer_rank = peer_rank
        self._self_rank = hello.src_rank
        self._on_broken = on_broken
        self._arena = arena
        self._data_host = data_host
        self._options = options or TransportOptions()
        self._cond = threading.Condition()
        self._state = StreamState.OPEN
        self._reason: Optional[str] = None  # why the stream broke
        self._queue: Deque[OutgoingMessage] = collections.deque()
        self._in_flight: Optional[OutgoingMessage] = None  # taken from the queue, being written
        self._goodbye = peer_pb2.Goodbye(reason="closed")
        offers = arena is not None or data_host is not None
        self._path: Optional[BytePath] = None if offers else GrpcPath()  # None: waiting for the peer's answer
        self._lane: Optional[SendLane] = None  # the arena's lane, once the peer mapped the arena
        self.bytes_sent = 0
        if offers:
            offering = peer_pb2.StreamHello()
            offering.CopyFrom(hello)
            if arena is not None:
                offering.shared_memory.CopyFrom(arena.offer())
            offering.data_socket = data_host is not None
            hello = offering
        call = channel.stream_stream(
            TRANSFER_METHOD, request_serializer=None, response_deserializer=peer_pb2.TransferReply.FromString
        )
        self._call = call(self._frames(frames.encode_hello(hello)), metadata=call_metadata(token), wait_for_ready=False)
        self._call.add_done_callback(self._on_call_done)
        self._reply_reader: Optional[threading.Thread] = None
        if offers:
            self._reply_reader = threading.Thread(
                target=self._read_replies, name=f"edl-replies-{peer_rank}", daemon=True
            )
            self._reply_reader.start()

    @property
    def uses_shared_memory(self) -> bool:
        """Whether the peer mapped this stream's arena (payloads then go through shared memory)."""
        return self._shared() is not None

    @property
    def uses_data_socket(self) -> bool:
        """Whether this stream's frames go over a direct data socket."""
        return isinstance(self._path, DataSocketPath)

    @property
    def shared_bytes_sent(self) -> int:
        """Payload bytes sent through shared memory (included in ``bytes_sent``)."""
        shared = self._shared()
        return shared.bytes_sent if shared is not None else 0

    def try_lane(self, header: peer_pb2.MessageHeader, payload: memoryview) -> bool:
        """Writes a message into the lane of this stream's arena, in the caller's thread.

        False, writing nothing, when the stream has no lane in use (no arena, the peer did
        not map it or has not answered yet, the stream is not open) or the message does not
        fit now: then :meth:`submit` it.
        """
        lane = self._lane
        if lane is None or self._state is not StreamState.OPEN:
            return False
        return lane.try_send(header.SerializeToString(), payload)

    def try_socket(
        self, header: peer_pb2.MessageHeader, payload: memoryview, on_block: Optional[Callable[[], None]] = None
    ) -> bool:
        """Writes a message on this stream's data socket in the caller's thread (no hand-off to the
        writer thread), blocking only while the socket's buffers are full (after calling
        ``on_block``: the peer may need this worker to read meanwhile).

        False, writing nothing, when the stream has no data socket in use (none, not yet, the
        payload goes another way: :meth:`DataSocketPath.takes_now`), the stream is not open, or
        another message is queued or being written: then :meth:`submit` it.

        Raises:
            PeerFailureError: the socket broke (the stream is broken from now on).
        """
        path = self._path
        if not isinstance(path, DataSocketPath) or not path.takes_now(len(payload)):
            return False
        with self._cond:
            if self._state is not StreamState.OPEN or self._queue or self._in_flight is not None:
                return False
            self._in_flight = _A_CALLER_WRITES  # the writer thread waits until it is written
        try:
            path.write_raw(header, payload, on_block)
        except DataSocketClosed as e:
            self._break(str(e))
            self._call.cancel()
            with self._cond:
                self._raise_unless_open()  # PeerFailureError with the stream's first reason
        except BaseException:  # interrupted (Ctrl-C) in the middle of a message: the stream cannot go on
            self.fail("the sender was interrupted in the middle of a message")
            raise
        with self._cond:
            self.bytes_sent += len(payload)
            if self._in_flight is _A_CALLER_WRITES:
                self._in_flight = None
                if self._queue or self._state is not StreamState.OPEN:
                    self._cond.notify_all()  # the writer thread has work again (else it need not wake)
        return True

    def submit(self, message: OutgoingMessage) -> None:
        """Queues ``message``; never blocks.

        Raises:
            PeerFailureError: the stream is broken.
            CommunicatorClosedError: the stream is closing.
        """
        with self._cond:
            self._raise_unless_open()
            self._queue.append(message)
            self._cond.notify()

    def close(self, timeout: float, goodbye: Optional[peer_pb2.Goodbye] = None) -> None:
        """Flushes queued messages, sends ``goodbye``, ends the stream and waits up to ``timeout`` for the peer."""
        with self._cond:
            if goodbye is not None:
                self._goodbye = goodbye
            self._move(StreamState.CLOSING)
        deadline = time.monotonic() + timeout
        try:
            self._call.result(timeout=timeout)
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError, futures.TimeoutError):
            if self._arena is not None:
                self._arena.release_mark()  # closing on purpose: the peer must not see a death
            self._call.cancel()
        if self._reply_reader is not None:
            self._reply_reader.join(timeout=max(0.1, deadline - time.monotonic()))
        socket = self._socket()
        if socket is not None:
            socket.close()

    def fail(self, reason: str) -> None:
        """Fails the stream from outside, its peer being known to be gone (say, its stream to us
        broke): every unsent message and every later :meth:`submit` raise ``PeerFailureError`` at
        once, and a write blocked on the data socket is woken. Without this a send to a peer cut
        off by the network waits on the dead connection until the collective's deadline."""
        self._break(reason)  # first: the write woken below must fail with this reason, not its broken pipe
        socket = self._socket()
        if socket is not None:
            socket.shutdown()
        self._call.cancel()

    # ---- state ------------------------------------------------------------------------------

    def _move(self, new: StreamState) -> bool:
        """Moves to ``new`` if that is a transition from the current state (under ``_cond``)."""
        if new not in _TRANSITIONS[self._state]:
            return False
        self._state = new
        self._cond.notify_all()
        return True

    def _raise_unless_open(self) -> None:
        if self._state is StreamState.BROKEN:
            raise PeerFailureError(
                f"rank {self._self_rank} cannot send to rank {self._peer_rank}: {self._reason}",
                peer_rank=self._peer_rank,
                rank=self._self_rank,
            )
        if self._state is not StreamState.OPEN:
            raise CommunicatorClosedError(
                f"rank {self._self_rank}: the stream to rank {self._peer_rank} is closed", rank=self._self_rank
            )

    def _break(self, reason: Optional[str]) -> None:
        """Ends the stream, failing every unsent message: BROKEN for ``reason`` (``on_broken`` told
        if it was open), or CLOSED when the call ended after :meth:`close` (``reason`` None)."""
        with self._cond:
            was_open = self._state is StreamState.OPEN
            if reason is None:
                self._move(StreamState.CLOSED)
            elif self._move(StreamState.BROKEN):
                self._reason = reason
            in_flight = self._in_flight
            pending = ([in_flight] if in_flight not in (None, _A_CALLER_WRITES) else []) + list(self._queue)
            self._queue.clear()
            self._in_flight = None
            cause = self._reason or reason or "stream closed"  # the first reason: later ones are its symptoms
        shared = self._shared()
        if shared is not None:
            shared.stop()
        if self._arena is not None:
            self._arena.release_mark()
        for message in pending:
            error = PeerFailureError(
                f"rank {self._self_rank} could not send to rank {self._peer_rank}: {cause}",
                peer_rank=self._peer_rank,
                rank=self._self_rank,
            )
            settle(message.future, error)
        if was_open and reason is not None:
            self._on_broken(reason)

    # ---- the writer thread ------------------------------------------------------------------

    def _frames(self, hello_frame: bytes) -> Iterator[bytes]:
        """The frames of the gRPC call, written by gRPC's request iterator: it asks for the next
        one only once the last was written."""
        yield hello_frame
        while True:
            message = self._next_message()
            if message is None:
                yield from self._goodbye_frames()
                return
            path = self._settled_path()
            if path is None:
                return  # the stream broke: _break failed the messages
            try:
                yield from path.frames(message.header, message.payload, message.chunk_size)
            except DataSocketClosed as e:
                self._break(str(e))
                self._call.cancel()
                return
            with self._cond:
                if self._in_flight is not message:
                    return  # broken while waiting for a slot: _break failed the message
                self._in_flight = None
            self.bytes_sent += len(message.payload)
            settle(message.future)

    def _next_message(self) -> Optional[OutgoingMessage]:
        """The next queued message, once no caller writes one (:meth:`try_socket`); None once the
        stream closes with an empty queue, or broke."""
        with self._cond:
            while self._in_flight is not None or not self._queue:
                if self._in_flight is None and self._state is not StreamState.OPEN:
                    return None
                self._cond.wait(_IDLE_POLL_S)
            self._in_flight = self._queue.popleft()
            return self._in_flight

    def _goodbye_frames(self) -> Iterator[bytes]:
        """The goodbye of a stream closing with nothing left to send (none for a broken one): on the
        path in use, on gRPC if the peer has not answered (no message was sent)."""
        with self._cond:
            if self._state is StreamState.BROKEN:
                return
            path = self._path or GrpcPath()
        if self._arena is not None:
            self._arena.release_mark()  # first: the peer must not take this clean end for a death
        try:
            yield from path.goodbye(self._goodbye)
        except DataSocketClosed as e:
            self._break(str(e))
            self._call.cancel()

    def _settled_path(self) -> Optional[BytePath]:
        """The path the peer's answer settled, waiting for it if it has not come (gRPC if it does
        not come in time); None once the stream is broken."""
        path = self._path
        if path is not None and self._state is not StreamState.BROKEN:
            return path  # settled: every message after the first
        deadline = time.monotonic() + _ANSWER_TIMEOUT_S
        with self._cond:
            while self._path is None and self._state is not StreamState.BROKEN:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning(
                        "rank %d: rank %d did not answer the shared-memory offer or data socket request "
                        "within %gs; sending over gRPC",
                        self._self_rank,
                        self._peer_rank,
                        _ANSWER_TIMEOUT_S,
                    )
                    self._path = GrpcPath()
                    break
                self._cond.wait(min(remaining, _IDLE_POLL_S))
            return None if self._state is StreamState.BROKEN else self._path

    # ---- the reply reader thread ------------------------------------------------------------

    def _read_replies(self) -> None:
        """Reads the peer's answer (connecting the data socket it offers), then the slots it hands back."""
        replies = iter(self._call)
        try:
            answer = next(replies)
            if self._arena is not None:
                self._arena.unlink()
            shared = None
            if self._arena is not None and answer.shared_memory_accepted:
                shared = SharedMemoryPath(self._arena)
            data_socket = self._connect_data_socket(answer) if answer.data_socket_port else None
            path = DataSocketPath(data_socket, shared) if data_socket is not None else GrpcPath(shared)
            if not self._settle(path):
                if data_socket is not None:
                    data_socket.close()
                return
            if shared is None:
                if self._arena is not None:
                    self._arena.release_mark()  # nobody watches it
                    logger.debug(
                        "rank %d -> rank %d: no shared memory (%s)",
                        self._self_rank,
                        self._peer_rank,
                        answer.shared_memory_refusal,
                    )
                return
            for reply in replies:
                shared.release(reply.released_slots)
        except (grpc.RpcError, StopIteration):
            pass  # the stream ended; _on_call_done reports why
        finally:
            if self._arena is not None:
                self._arena.unlink()

    def _settle(self, path: BytePath) -> bool:
        """Makes ``path`` the stream's; False if the writer gave up waiting or the stream broke."""
        with self._cond:
            if self._path is not None or self._state is StreamState.BROKEN:
                return False
            self._path = path
            shared = path.shared if isinstance(path, (GrpcPath, DataSocketPath)) else None
            if shared is not None:
                self._lane = shared.arena.lane
            self._cond.notify_all()
            return True

    def _connect_data_socket(self, answer: peer_pb2.TransferReply) -> Optional[FrameSocket]:
        options, host = self._options, self._data_host
        if host is None:
            return None
        try:
            return connect(
                host,
                answer.data_socket_port,
                answer.data_socket_ticket,
                min(options.connect_timeout_s, _DATA_CONNECT_TIMEOUT_S),
                options.keepalive_s,
                options.message_limit,
                tls=options.tls.client_ssl_context() if options.tls is not None else None,
                server_name=options.tls.server_name if options.tls is not None else None,
            )
        except OSError as e:
            logger.warning(
                "rank %d: cannot connect a data socket to rank %d at %s:%d (%s); sending over gRPC "
                "(open that port between workers, or set EDL_DATA_SOCKET=0)",
                self._self_rank,
                self._peer_rank,
                host,
                answer.data_socket_port,
                e,
            )
            return None

    # ---- gRPC's callback thread -------------------------------------------------------------

    def _on_call_done(self, call: grpc.Future) -> None:
        if call.cancelled():
            reason: Optional[str] = "the stream was cancelled"
        else:
            error = call.exception()
            if error is None and self._state is not StreamState.OPEN:
                reason = None
            elif error is None:
                reason = "the peer ended the stream"
            else:
                reason = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.Call) else repr(error)
        self._break(reason)
        socket = self._socket()
        if socket is not None:
            socket.shutdown()  # wakes a write blocked on a peer that is gone

    def _shared(self) -> Optional[SharedMemoryPath]:
        path = self._path
        return path.shared if isinstance(path, (GrpcPath, DataSocketPath)) else None

    def _socket(self) -> Optional[FrameSocket]:
        path = self._path
        return path.socket if isinstance(path, DataSocketPath) else None
