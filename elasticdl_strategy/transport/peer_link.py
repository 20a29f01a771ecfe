"""Streams between workers: the sending side (:class:`OutboundStream`) and the
``Peer`` service that receives them (:class:`PeerService`).

A sender keeps one ``Transfer`` stream open per peer for the life of a
communicator. Messages are queued without blocking and written in order by
gRPC's request-iterator thread, chunk by chunk, straight from the caller's
array. The receiving side parses frames and hands headers and chunk payloads
to a :class:`StreamListener`; what is done with them (matching, copying,
reducing) belongs to the collective layer.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent import futures
from typing import Callable, Deque, Optional, Protocol, Tuple

import grpc

from elasticdl_strategy.errors import CommunicatorClosedError, PeerFailureError
from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.auth import call_metadata
from elasticdl_strategy.transport.protos import peer_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = "elasticdl_strategy.peer.Peer"
TRANSFER_METHOD = f"/{SERVICE_NAME}/Transfer"
ABORT_METHOD = f"/{SERVICE_NAME}/Abort"

# How often idle waits wake up to check for shutdown.
_IDLE_POLL_S = 1.0


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

    __slots__ = ("header_frame", "payload", "chunk_size", "future")

    def __init__(self, header_frame: bytes, payload: memoryview, chunk_size: int):
        self.header_frame = header_frame
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
    """

    def __init__(
        self,
        channel: grpc.Channel,
        hello: peer_pb2.StreamHello,
        token: str,
        peer_rank: int,
        on_broken: Callable[[str], None],
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
        self.bytes_sent = 0
        call = channel.stream_unary(
            TRANSFER_METHOD,
            request_serializer=None,
            response_deserializer=peer_pb2.TransferSummary.FromString,
        )
        self._call = call.future(
            self._frames(frames.encode_hello(hello)), metadata=call_metadata(token), wait_for_ready=False
        )
        self._call.add_done_callback(self._on_call_done)

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
        try:
            self._call.result(timeout=timeout)
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError, futures.TimeoutError):
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
                    yield frames.encode_goodbye(self._goodbye)
                return
            yield message.header_frame
            payload, size = message.payload, message.chunk_size
            for offset in range(0, len(payload), size):
                yield frames.encode_chunk(payload[offset : offset + size])
            # gRPC asks for the next frame only once the last one was written.
            self.bytes_sent += len(payload)
            self._in_flight = None
            settle(message.future)

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
    def write(self, offset: int, data: memoryview) -> None:
        """Stores ``data`` at byte ``offset`` of the message."""

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
    """Server side of the ``Peer`` service, dispatching to a :class:`StreamListener`."""

    def __init__(self, listener: StreamListener):
        self._listener = listener

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Transfer": grpc.stream_unary_rpc_method_handler(
                    self._transfer,
                    request_deserializer=None,
                    response_serializer=peer_pb2.TransferSummary.SerializeToString,
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

    def _transfer(self, frame_iterator, context) -> peer_pb2.TransferSummary:
        frame_iterator = iter(frame_iterator)
        try:
            first = frames.decode_control(next(frame_iterator))
            if first.WhichOneof("kind") != "hello":
                raise ValueError("a Transfer stream must start with a hello frame")
            receiver = self._listener.open_stream(first.hello)
        except (StopIteration, ValueError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stream rejected: {e}")
        error: Optional[str] = "the stream ended without a goodbye (the sender died or lost its connection)"
        messages, goodbye = 0, None
        try:
            messages, goodbye = self._receive(frame_iterator, receiver)
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
        if error is not None:
            context.abort(grpc.StatusCode.DATA_LOSS, error)
        return peer_pb2.TransferSummary(messages=messages)

    @staticmethod
    def _receive(frame_iterator, receiver: StreamReceiver) -> Tuple[int, peer_pb2.Goodbye]:
        messages = 0
        for frame in frame_iterator:
            control = frames.decode_control(frame)
            if control.WhichOneof("kind") == "goodbye":
                return messages, control.goodbye
            header = control.header
            writer = receiver.on_header(header)
            if header.inline_data or header.nbytes == 0:
                if header.inline_data:
                    writer.write(0, memoryview(header.inline_data))
            else:
                offset = 0
                while offset < header.nbytes:
                    chunk = next(frame_iterator, None)
                    if chunk is None:
                        raise _IncompleteMessage()
                    payload = frames.chunk_payload(chunk)
                    writer.write(offset, payload)
                    offset += len(payload)
            writer.finish()
            messages += 1
        raise _IncompleteMessage()  # ended without a goodbye: the sender died


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
