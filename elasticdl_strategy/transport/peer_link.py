"""Streams between workers: the sending side (:class:`OutboundStream`) and the
``Peer`` service that receives them (:class:`PeerService`).

A sender keeps one ``Transfer`` stream open per peer for the life of a
communicator. Messages are queued without blocking and written in order by
gRPC's request-iterator thread. Where the bytes go is settled when the stream
opens: once the peer has answered with a direct data socket
(:mod:`~elasticdl_strategy.transport.data_socket`), every frame goes there and
payloads follow raw; large payloads go through the sender's shared-memory arena
instead when the peer has mapped it (same host, see
:mod:`~elasticdl_strategy.transport.shared_memory`), with only a small frame per
slot; without a data socket, frames and chunks stay on the gRPC stream. The
receiving side parses frames and hands headers and payloads to a
:class:`StreamListener`; what is done with them (matching, copying, reducing)
belongs to the collective layer.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent import futures
from typing import Callable, Deque, Iterator, Optional, Protocol

import grpc
import numpy as np

from elasticdl_strategy.errors import CommunicationError, CommunicatorClosedError, DataSocketClosed, PeerFailureError
from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.auth import call_metadata
from elasticdl_strategy.transport.data_socket import DataSocketListener, FrameSocket, connect
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.refusals import grpc_peer_host
from elasticdl_strategy.transport.shared_memory import ReceiveArena, SendArena

logger = logging.getLogger(__name__)

SERVICE_NAME = "elasticdl_strategy.peer.Peer"
TRANSFER_METHOD = f"/{SERVICE_NAME}/Transfer"
ABORT_METHOD = f"/{SERVICE_NAME}/Abort"

# How often idle waits wake up to check for shutdown.
_IDLE_POLL_S = 1.0
# How long the first message waits for the peer to answer a shared-memory offer or data socket request.
_ANSWER_TIMEOUT_S = 10.0
# At most this long to connect a data socket (and have its ticket accepted) before staying on gRPC:
# a firewalled data port must not hold up every stream of every membership for long.
_DATA_CONNECT_TIMEOUT_S = 3.0
# Payload bytes read from a data socket before they are handed on (reduced or copied). Measured
# (N = 2, alternating runs): 256 MiB 152-162 ms with 4 MiB pieces, 181-187 with 1 MiB, 198 with 256 KiB.
_SOCKET_PIECE = 1 << 22
# With both a data socket and a mapped arena, payloads up to this size still go raw on the socket:
# measured at 256 KiB and 1 MiB (N = 2 and 4), the slot round trip costs more than the kernel's copies.
_RAW_ON_SOCKET_MAX_BYTES = 1 << 20


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


class OutboundStream:
    """The long-lived ``Transfer`` stream from this worker to one peer.

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
        self._queue: Deque[OutgoingMessage] = collections.deque()
        self._in_flight: Optional[OutgoingMessage] = None  # popped, frames being written
        self._cond = threading.Condition()
        self._closing = False
        self._goodbye = peer_pb2.Goodbye(reason="closed")
        self._error: Optional[str] = None
        self._arena = arena
        self._arena_accepted = False
        self._path_settled = False  # the peer answered the shared-memory / data-socket offer, or we stopped waiting
        self._reply_reader: Optional[threading.Thread] = None
        self._free_slots: Deque[int] = collections.deque(range(arena.slots) if arena is not None else ())
        self._data_host = data_host
        self._options = options or TransportOptions()
        self._socket: Optional[FrameSocket] = None
        self._attached = False  # data_socket_attached was sent: every later frame goes on the socket
        self.bytes_sent = 0
        self.shared_bytes_sent = 0  # of bytes_sent, those that went through shared memory
        if arena is not None or data_host is not None:
            offering = peer_pb2.StreamHello()
            offering.CopyFrom(hello)
            if arena is not None:
                offering.shared_memory.CopyFrom(arena.offer())
            offering.data_socket = data_host is not None
            hello = offering
        call = channel.stream_stream(
            TRANSFER_METHOD,
            request_serializer=None,
            response_deserializer=peer_pb2.TransferReply.FromString,
        )
        self._call = call(self._frames(frames.encode_hello(hello)), metadata=call_metadata(token), wait_for_ready=False)
        self._call.add_done_callback(self._on_call_done)
        if arena is not None or data_host is not None:
            self._reply_reader = threading.Thread(
                target=self._read_replies, name=f"edl-replies-{peer_rank}", daemon=True
            )
            self._reply_reader.start()

    @property
    def uses_shared_memory(self) -> bool:
        """Whether the peer mapped this stream's arena (payloads then go through shared memory)."""
        return self._arena_accepted

    @property
    def uses_data_socket(self) -> bool:
        """Whether this stream's frames go over a direct data socket."""
        return self._attached

    def try_lane(self, header: peer_pb2.MessageHeader, payload: memoryview) -> bool:
        """Writes a small message into the lane of this stream's arena, in the caller's thread.

        False, writing nothing, when the stream has no lane in use (no arena, the peer did
        not map it or has not answered yet, the stream ended) or the message does not fit
        now: then :meth:`submit` it.
        """
        arena = self._arena
        if arena is None or arena.lane is None or not self._arena_accepted or self._error is not None:
            return False
        if self._closing:
            return False
        return arena.lane.try_send(header.SerializeToString(), payload)

    def submit(self, message: OutgoingMessage) -> None:
        """Queues ``message``; never blocks.

        Raises:
            PeerFailureError: the stream is broken.
            CommunicatorClosedError: the stream is closing.
        """
        with self._cond:
            self._raise_if_unusable()
            self._queue.append(message)
            self._cond.notify()

    def close(self, timeout: float, goodbye: Optional[peer_pb2.Goodbye] = None) -> None:
        """Flushes queued messages, sends ``goodbye``, ends the stream and waits up to ``timeout`` for the peer."""
        with self._cond:
            if goodbye is not None:
                self._goodbye = goodbye
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        try:
            self._call.result(timeout=timeout)
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError, futures.TimeoutError):
            self._call.cancel()
        if self._reply_reader is not None:
            self._reply_reader.join(timeout=max(0.1, deadline - time.monotonic()))
        if self._socket is not None:
            self._socket.close()

    def fail(self, reason: str) -> None:
        """Fails the stream from outside, its peer being known to be gone (say, its stream to us
        broke): every unsent message and every later :meth:`submit` raise ``PeerFailureError`` at
        once, and a write blocked on the data socket is woken. Without this a send to a peer cut
        off by the network waits on the dead connection until the collective's deadline."""
        self._fail(reason)  # first: the write woken below must fail with this reason, not its broken pipe
        if self._socket is not None:
            self._socket.shutdown()
        self._call.cancel()

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            raise PeerFailureError(
                f"rank {self._self_rank} cannot send to rank {self._peer_rank}: {self._error}",
                peer_rank=self._peer_rank,
                rank=self._self_rank,
            )
        if self._closing:
            raise CommunicatorClosedError(
                f"rank {self._self_rank}: the stream to rank {self._peer_rank} is closed", rank=self._self_rank
            )

    def _next_message(self) -> Optional[OutgoingMessage]:
        with self._cond:
            while not self._queue:
                if self._closing or self._error is not None:
                    return None
                self._cond.wait(_IDLE_POLL_S)
            self._in_flight = self._queue.popleft()
            return self._in_flight

    def _frames(self, hello_frame: bytes):
        yield hello_frame
        while True:
            message = self._next_message()
            if message is None:
                if self._error is None:
                    if self._attached:
                        self._write_to_socket(frames.encode_goodbye(self._goodbye))
                    else:
                        yield frames.encode_goodbye(self._goodbye)
                return
            if not self._await_answer():
                return  # the stream broke: _on_call_done fails this message
            if self._socket is not None and not self._attached:
                self._attached = True
                yield frames.encode_data_socket_attached()
            header, payload = message.header, message.payload
            if self._attached:
                if not self._send_on_socket(header, payload):
                    return  # the stream broke: this message was failed with it
            elif len(payload) and self._arena_accepted:
                for frame in self._shared_frames(header, payload):
                    if frame is None:
                        return  # the stream broke: _on_call_done fails this message
                    yield frame
            elif 0 < len(payload) <= message.chunk_size:
                yield frames.encode_whole_message(payload, header)
            else:
                yield frames.encode_header(header)
                size = message.chunk_size
                for offset in range(0, len(payload), size):
                    yield frames.encode_chunk(payload[offset : offset + size])
            # gRPC asks for the next frame only once the last one was written.
            self.bytes_sent += len(payload)
            self._in_flight = None
            settle(message.future)

    def _send_on_socket(self, header: peer_pb2.MessageHeader, payload: memoryview) -> bool:
        """Sends one message on the data socket: its payload raw after the header, or through the
        arena's slots with only their frames on the socket. False once the stream is broken."""
        if not (len(payload) > _RAW_ON_SOCKET_MAX_BYTES and self._arena_accepted):
            return self._write_to_socket(frames.encode_header(header), payload)
        for frame in self._shared_frames(header, payload):
            if frame is None or not self._write_to_socket(frame):
                return False
        return True

    def _shared_frames(self, header: peer_pb2.MessageHeader, payload: memoryview) -> Iterator[Optional[bytes]]:
        """The frames of a message whose payload goes through the arena, each slot filled when it is
        free (the first piece rides in the header); ``None`` when the stream broke while waiting."""
        arena = self._arena
        assert arena is not None, "only a stream with an arena sends through one"
        piece = arena.slot_size
        for offset in range(0, len(payload), piece):
            slot = self._free_slot()
            if slot is None:
                yield None
                return
            nbytes = arena.fill(slot, payload[offset : offset + piece])
            self.shared_bytes_sent += nbytes
            if offset == 0:
                header.shared_chunk.slot, header.shared_chunk.nbytes = slot, nbytes
                yield frames.encode_header(header)
            else:
                yield frames.encode_shared_chunk(slot, nbytes)

    def _write_to_socket(self, frame: bytes, payload: Optional[memoryview] = None) -> bool:
        """Writes a frame (and its payload) on the data socket; False, with the stream failed, if it broke."""
        assert self._socket is not None, "only an attached stream writes to its socket"
        try:
            self._socket.send_frame(frame, payload)
            return True
        except DataSocketClosed as e:
            self._fail(str(e))
            self._call.cancel()
            return False

    def _await_answer(self) -> bool:
        """Waits (once, before the first message) for the peer's answer to the arena offer
        or data socket request.

        Returns False when the stream broke meanwhile.
        """
        if self._reply_reader is None or self._path_settled:
            return True
        deadline = time.monotonic() + _ANSWER_TIMEOUT_S
        with self._cond:
            while not self._path_settled and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning(
                        "rank %d: rank %d did not answer the shared-memory offer or data socket request "
                        "within %gs; sending over gRPC",
                        self._self_rank,
                        self._peer_rank,
                        _ANSWER_TIMEOUT_S,
                    )
                    self._path_settled = True
                    break
                self._cond.wait(min(remaining, _IDLE_POLL_S))
            return self._error is None

    def _free_slot(self) -> Optional[int]:
        """Waits until the peer has handed a slot back; ``None`` once the stream is broken."""
        with self._cond:
            while not self._free_slots:
                if self._error is not None:
                    return None
                self._cond.wait(_IDLE_POLL_S)
            return self._free_slots.popleft()

    def _read_replies(self) -> None:
        """Reads the peer's answer (connecting the data socket it offers), then the slots it hands back."""
        replies = iter(self._call)
        try:
            answer = next(replies)
            if self._arena is not None:
                self._arena.unlink()
            data_socket = self._connect_data_socket(answer) if answer.data_socket_port else None
            with self._cond:
                late = self._path_settled  # _await_answer gave up and went on over gRPC
                self._arena_accepted = answer.shared_memory_accepted and not late
                if data_socket is not None and not late:
                    self._socket, data_socket = data_socket, None
                self._path_settled = True
                self._cond.notify_all()
            if data_socket is not None:
                data_socket.close()
            if not answer.shared_memory_accepted:
                if self._arena is not None:
                    logger.debug(
                        "rank %d -> rank %d: no shared memory (%s)",
                        self._self_rank,
                        self._peer_rank,
                        answer.shared_memory_refusal,
                    )
                return
            for reply in replies:
                with self._cond:
                    self._free_slots.extend(reply.released_slots)
                    self._cond.notify_all()
        except (grpc.RpcError, StopIteration):
            pass  # the stream ended; _on_call_done reports why
        finally:
            if self._arena is not None:
                self._arena.unlink()

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
                self._data_host,
                answer.data_socket_port,
                e,
            )
            return None

    def _on_call_done(self, call: grpc.Future) -> None:
        if call.cancelled():
            reason = "the stream was cancelled"
        else:
            error = call.exception()
            if error is None and self._closing:
                reason = None
            elif error is None:
                reason = "the peer ended the stream"
            else:
                reason = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.Call) else repr(error)
        self._fail(reason)
        if self._socket is not None:
            self._socket.shutdown()  # wakes a write blocked on a peer that is gone

    def _fail(self, reason: Optional[str]) -> None:
        """Fails every unsent message; reports ``reason`` (once) unless the stream is closing."""
        with self._cond:
            first = reason is not None and self._error is None
            if first:
                self._error = reason
            pending = ([self._in_flight] if self._in_flight is not None else []) + list(self._queue)
            self._queue.clear()
            self._in_flight = None
            self._cond.notify_all()
            cause = self._error or reason or "stream closed"  # the first reason: later ones are its symptoms
        for message in pending:
            settle(
                message.future,
                PeerFailureError(
                    f"rank {self._self_rank} could not send to rank {self._peer_rank}: {cause}",
                    peer_rank=self._peer_rank,
                    rank=self._self_rank,
                ),
            )
        if first and reason is not None and not self._closing:
            self._on_broken(reason)


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


class StreamListener(Protocol):
    def open_stream(self, hello: peer_pb2.StreamHello) -> StreamReceiver:
        """Accepts a new stream or raises ``ValueError`` saying why not."""

    def on_abort(self, request: peer_pb2.AbortRequest) -> None:
        """A peer reports that the current collective failed."""


class PeerService:
    """Server side of the ``Peer`` service, dispatching to a :class:`StreamListener`.

    Args:
        listener: where streams and aborts go.
        shared_memory_dir: directory in which senders' shared-memory arenas
            are looked up; ``None`` refuses every offer.
        data_sockets: where senders' data sockets arrive; ``None`` keeps
            every stream on gRPC.
        attach_timeout_s: how long a stream waits for the data socket its
            sender says it has connected.
    """

    def __init__(
        self,
        listener: StreamListener,
        shared_memory_dir: Optional[str] = None,
        data_sockets: Optional[DataSocketListener] = None,
        attach_timeout_s: float = 10.0,
    ):
        self._listener = listener
        self._shared_memory_dir = shared_memory_dir
        self._data_sockets = data_sockets
        self._attach_timeout_s = attach_timeout_s

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Transfer": grpc.stream_stream_rpc_method_handler(
                    self._transfer,
                    request_deserializer=None,
                    response_serializer=peer_pb2.TransferReply.SerializeToString,
                ),
                "Abort": grpc.unary_unary_rpc_method_handler(
                    self._abort,
                    request_deserializer=peer_pb2.AbortRequest.FromString,
                    response_serializer=peer_pb2.AbortResponse.SerializeToString,
                ),
            },
        )

    def _abort(self, request: peer_pb2.AbortRequest, context) -> peer_pb2.AbortResponse:
        self._listener.on_abort(request)
        return peer_pb2.AbortResponse()

    def _transfer(self, frame_iterator, context) -> Iterator[peer_pb2.TransferReply]:
        frame_iterator = iter(frame_iterator)
        try:
            first = frames.decode_control(next(frame_iterator))
            if first.WhichOneof("kind") != "hello":
                raise ValueError("a Transfer stream must start with a hello frame")
            receiver = self._listener.open_stream(first.hello)
        except (StopIteration, ValueError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stream rejected: {e}")
        hello, arena, ticket, answer = first.hello, None, None, None
        if hello.HasField("shared_memory") or hello.data_socket:
            answer = peer_pb2.TransferReply()
            if hello.HasField("shared_memory"):
                arena, answer.shared_memory_refusal = ReceiveArena.open(self._shared_memory_dir, hello.shared_memory)
                answer.shared_memory_accepted = arena is not None
                attach_lane = getattr(receiver, "attach_lane", None)  # receivers that read lanes have it
                if arena is not None and arena.lane is not None and attach_lane is not None:
                    attach_lane(arena.lane)
            if hello.data_socket and self._data_sockets is not None:
                ticket = self._data_sockets.expect(source=grpc_peer_host(context.peer()))
                answer.data_socket_port, answer.data_socket_ticket = self._data_sockets.port, ticket
        error: Optional[str] = "the stream ended without a goodbye (the sender died or lost its connection)"
        goodbye = None
        try:
            if answer is not None:
                yield answer  # inside the try: if gRPC drops the call here, the cleanup below still runs
            goodbye = yield from self._receive(frame_iterator, receiver, arena, lambda: self._attach(ticket, context))
            error = None
        except (grpc.RpcError, DataSocketClosed):
            error = "the connection broke (the sender died or the network failed)"
        except _IncompleteMessage:
            pass
        except Exception as e:  # a bug or a corrupt frame: the stream cannot continue
            logger.exception("receiving stream failed")
            error = f"receiving failed: {e!r}"
        finally:
            receiver.on_closed(error, goodbye)
            if arena is not None:
                arena.close()
            if ticket is not None and self._data_sockets is not None:
                self._data_sockets.discard(ticket)
        if error is not None:
            context.abort(grpc.StatusCode.DATA_LOSS, error)

    def _attach(self, ticket: Optional[bytes], context) -> FrameSocket:
        """Takes the data socket the sender connected with ``ticket``; it is shut down when the call ends."""
        if ticket is None or self._data_sockets is None:
            raise ValueError("data_socket_attached on a stream that was not given a data socket")
        try:
            data_socket = self._data_sockets.claim(ticket, self._attach_timeout_s)
        except TimeoutError as e:
            raise ValueError(f"the sender attached a data socket that never arrived: {e}") from None
        if not context.add_callback(data_socket.shutdown):
            data_socket.shutdown()  # the call has already ended
        return data_socket

    @staticmethod
    def _receive(frame_iterator, receiver: StreamReceiver, arena: Optional[ReceiveArena], attach):
        """Delivers messages until the goodbye, which it returns; yields the replies that hand slots back.

        ``attach()`` returns the data socket once the sender says the rest of the stream is on it.
        """
        for frame in frame_iterator:
            if frames.is_chunk(frame):  # a whole message in one frame
                whole = frames.split_whole_message(frame)
                if whole is None:
                    raise ValueError("a chunk frame without a message header")
                payload, header = whole
                writer = receiver.on_header(header)
                writer.write(0, payload)
                writer.finish()
                continue
            control = frames.decode_control(frame)
            if control.WhichOneof("kind") == "goodbye":
                return control.goodbye
            if control.WhichOneof("kind") == "data_socket_attached":
                data_socket = attach()
                try:
                    goodbye = yield from PeerService._receive_from_socket(data_socket, receiver, arena)
                finally:
                    data_socket.close()
                if next(frame_iterator, None) is not None:
                    raise ValueError("a frame on gRPC after the stream moved to its data socket")
                return goodbye
            header = control.header
            writer = receiver.on_header(header)
            if header.inline_data or header.nbytes == 0:
                if header.inline_data:
                    writer.write(0, memoryview(header.inline_data))
            else:
                offset = 0
                if header.HasField("shared_chunk"):
                    offset = yield from PeerService._read_shared(arena, header.shared_chunk, writer, offset)
                while offset < header.nbytes:
                    chunk = next(frame_iterator, None)
                    if chunk is None:
                        raise _IncompleteMessage()
                    if frames.is_chunk(chunk):
                        payload = frames.chunk_payload(chunk)
                        writer.write(offset, payload)
                        offset += len(payload)
                    else:
                        control = frames.decode_control(chunk)
                        if control.WhichOneof("kind") != "shared_chunk":
                            raise ValueError(f"a {control.WhichOneof('kind')} frame inside a message's payload")
                        offset = yield from PeerService._read_shared(arena, control.shared_chunk, writer, offset)
            writer.finish()
        raise _IncompleteMessage()  # ended without a goodbye: the sender died

    @staticmethod
    def _receive_from_socket(data_socket: FrameSocket, receiver: StreamReceiver, arena: Optional[ReceiveArena]):
        """Delivers the messages that arrive on ``data_socket`` until the goodbye, which it returns;
        yields the replies that hand arena slots back."""
        scratch = None  # one piece of payload at a time, reused for every message of the stream
        while True:
            control = frames.decode_control(data_socket.recv_frame())
            kind = control.WhichOneof("kind")
            if kind == "goodbye":
                return control.goodbye
            if kind != "header":
                raise ValueError(f"a {kind} frame on a data socket")
            header = control.header
            writer = receiver.on_header(header)
            if header.inline_data:
                writer.write(0, memoryview(header.inline_data))
            elif header.HasField("shared_chunk"):
                offset = yield from PeerService._read_shared(arena, header.shared_chunk, writer, 0)
                while offset < header.nbytes:
                    control = frames.decode_control(data_socket.recv_frame())
                    if control.WhichOneof("kind") != "shared_chunk":
                        raise ValueError(f"a {control.WhichOneof('kind')} frame inside a message's payload")
                    offset = yield from PeerService._read_shared(arena, control.shared_chunk, writer, offset)
            elif header.nbytes:
                if scratch is None or len(scratch) < min(header.nbytes, _SOCKET_PIECE):
                    scratch = np.empty(min(header.nbytes, _SOCKET_PIECE), np.uint8).data
                for offset in range(0, header.nbytes, len(scratch)):
                    n = min(len(scratch), header.nbytes - offset)
                    target = writer.target(offset, n)
                    if target is not None:
                        try:
                            data_socket.recv_into(target)  # straight into the receive's buffer
                        finally:
                            writer.target_done()
                        continue
                    data_socket.recv_into(scratch[:n])
                    writer.write(offset, scratch[:n], borrowed=True)
            writer.finish()

    @staticmethod
    def _read_shared(arena: Optional[ReceiveArena], shared: peer_pb2.SharedChunk, writer, offset: int):
        """Hands a shared-memory piece to ``writer``, yields the reply that hands slots back when one is due;
        returns the next offset."""
        if arena is None:
            raise ValueError("a shared-memory chunk on a stream without an arena")
        with arena.view(shared) as payload:
            writer.write(offset, payload, borrowed=True)
        released = arena.consumed(shared.slot)
        if released:
            yield peer_pb2.TransferReply(released_slots=released)
        return offset + shared.nbytes


class _IncompleteMessage(CommunicationError):
    """The stream ended inside a message, or without a goodbye: the sender died."""

    def __init__(self, message: str = "the stream ended in the middle of a message"):
        super().__init__(message)


def send_abort(channel: grpc.Channel, token: str, request: peer_pb2.AbortRequest, timeout: float) -> futures.Future:
    """Sends an Abort to one peer without waiting.

    Keep a reference to the returned future until it is done: gRPC cancels
    calls whose future is garbage-collected.
    """
    call = channel.unary_unary(
        ABORT_METHOD,
        request_serializer=peer_pb2.AbortRequest.SerializeToString,
        response_deserializer=peer_pb2.AbortResponse.FromString,
    )
    return call.future(request, timeout=timeout, metadata=call_metadata(token))
