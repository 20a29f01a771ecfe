"""Streams between workers: the sending side (:class:`OutboundStream`) and the
``Peer`` service that receives them (:class:`PeerService`).

A sender keeps one ``Transfer`` stream open per peer for the life of a
communicator. Messages are queued without blocking and written in order by
gRPC's request-iterator thread, chunk by chunk, straight from the caller's
array — or, once the peer has mapped the sender's shared-memory arena
(same host, see :mod:`~elasticdl_strategy.transport.shared_memory`), copied
into the arena's slots with only a small frame per chunk on the stream. The
receiving side parses frames and hands headers and chunk payloads to a
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

from elasticdl_strategy.errors import CommunicatorClosedError, PeerFailureError
from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.auth import call_metadata
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import ReceiveArena, SendArena

logger = logging.getLogger(__name__)

SERVICE_NAME = "elasticdl_strategy.peer.Peer"
TRANSFER_METHOD = f"/{SERVICE_NAME}/Transfer"
ABORT_METHOD = f"/{SERVICE_NAME}/Abort"

# How often idle waits wake up to check for shutdown.
_IDLE_POLL_S = 1.0
# How long the first payload waits for the peer to answer a shared-memory offer.
_ANSWER_TIMEOUT_S = 10.0


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
    """

    def __init__(
        self,
        channel: grpc.Channel,
        hello: peer_pb2.StreamHello,
        token: str,
        peer_rank: int,
        on_broken: Callable[[str], None],
        arena: Optional[SendArena] = None,
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
        self._arena_answered = False
        self._reply_reader: Optional[threading.Thread] = None
        self._free_slots: Deque[int] = collections.deque(range(arena.slots) if arena is not None else ())
        self.bytes_sent = 0
        self.shared_bytes_sent = 0  # of bytes_sent, those that went through shared memory
        if arena is not None:
            offering = peer_pb2.StreamHello()
            offering.CopyFrom(hello)
            offering.shared_memory.CopyFrom(arena.offer())
            hello = offering
        call = channel.stream_stream(
            TRANSFER_METHOD,
            request_serializer=None,
            response_deserializer=peer_pb2.TransferReply.FromString,
        )
        self._call = call(self._frames(frames.encode_hello(hello)), metadata=call_metadata(token), wait_for_ready=False)
        self._call.add_done_callback(self._on_call_done)
        if arena is not None:
            self._reply_reader = threading.Thread(
                target=self._read_replies, name=f"edl-replies-{peer_rank}", daemon=True
            )
            self._reply_reader.start()

    @property
    def uses_shared_memory(self) -> bool:
        """Whether the peer mapped this stream's arena (payloads then go through shared memory)."""
        return self._arena_accepted

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
                    yield frames.encode_goodbye(self._goodbye)
                return
            header, payload = message.header, message.payload
            if len(payload) and self._await_answer() and self._arena_accepted:
                piece = self._arena.slot_size
                for offset in range(0, len(payload), piece):
                    slot = self._free_slot()
                    if slot is None:
                        return  # the stream broke: _on_call_done fails this message
                    nbytes = self._arena.fill(slot, payload[offset : offset + piece])
                    self.shared_bytes_sent += nbytes
                    if offset == 0:
                        header.shared_chunk.slot, header.shared_chunk.nbytes = slot, nbytes
                        yield frames.encode_header(header)
                    else:
                        yield frames.encode_shared_chunk(slot, nbytes)
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

    def _await_answer(self) -> bool:
        """Waits (once, before the first payload) for the peer's answer to the arena offer.

        Returns False when the stream broke meanwhile.
        """
        if self._arena is None or self._arena_answered:
            return True
        deadline = time.monotonic() + _ANSWER_TIMEOUT_S
        with self._cond:
            while not self._arena_answered and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning(
                        "rank %d: rank %d did not answer the shared-memory offer within %gs; sending over gRPC",
                        self._self_rank,
                        self._peer_rank,
                        _ANSWER_TIMEOUT_S,
                    )
                    self._arena_answered = True
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
        """Reads the peer's answer to the shared-memory offer, then the slots it hands back."""
        replies = iter(self._call)
        try:
            answer = next(replies)
            self._arena.unlink()
            with self._cond:
                self._arena_accepted = answer.shared_memory_accepted and not self._arena_answered
                self._arena_answered = True
                self._cond.notify_all()
            if not answer.shared_memory_accepted:
                logger.debug(
                    "rank %d -> rank %d: no shared memory (%s); sending over gRPC",
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
            self._arena.unlink()

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
        with self._cond:
            if reason is not None and self._error is None:
                self._error = reason
            pending = ([self._in_flight] if self._in_flight is not None else []) + list(self._queue)
            self._queue.clear()
            self._in_flight = None
            self._cond.notify_all()
        for message in pending:
            settle(
                message.future,
                PeerFailureError(
                    f"rank {self._self_rank} could not send to rank {self._peer_rank}: {reason or 'stream closed'}",
                    peer_rank=self._peer_rank,
                    rank=self._self_rank,
                ),
            )
        if reason is not None and not self._closing:
            self._on_broken(reason)


class MessageWriter(Protocol):
    def write(self, offset: int, data: memoryview, borrowed: bool = False) -> None:
        """Stores ``data`` at byte ``offset`` of the message.

        ``borrowed`` data (a shared-memory slot) is reused once this returns:
        keep a copy, not the view.
        """

    def finish(self) -> None:
        """All bytes of the message were written."""


class StreamReceiver(Protocol):
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
    """

    def __init__(self, listener: StreamListener, shared_memory_dir: Optional[str] = None):
        self._listener = listener
        self._shared_memory_dir = shared_memory_dir

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
        arena = None
        if first.hello.HasField("shared_memory"):
            arena, refusal = ReceiveArena.open(self._shared_memory_dir, first.hello.shared_memory)
            yield peer_pb2.TransferReply(shared_memory_accepted=arena is not None, shared_memory_refusal=refusal)
        error: Optional[str] = "the stream ended without a goodbye (the sender died or lost its connection)"
        goodbye = None
        try:
            goodbye = yield from self._receive(frame_iterator, receiver, arena)
            error = None
        except grpc.RpcError:
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
        if error is not None:
            context.abort(grpc.StatusCode.DATA_LOSS, error)

    @staticmethod
    def _receive(frame_iterator, receiver: StreamReceiver, arena: Optional[ReceiveArena]):
        """Delivers messages until the goodbye, which it returns; yields the replies that hand slots back."""
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


class _IncompleteMessage(Exception):
    pass


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
