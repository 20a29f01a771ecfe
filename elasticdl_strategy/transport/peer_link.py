"""The ``Peer`` service, by which workers send each other streams of messages and aborts.

Its server side is :class:`PeerService`: it accepts a sender's ``Transfer``
stream, answers the hello's offers (the sender's shared-memory arena, a direct
data socket) and hands the stream's messages to a :class:`StreamListener`
through :func:`~.inbound.receive_messages`. The sending side of a stream is
:class:`~.outbound.OutboundStream`; an abort is sent with :func:`send_abort`.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Iterator, List, Optional, Protocol

import grpc

from elasticdl_strategy.errors import DataSocketClosed, IncompleteStream
from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.auth import call_metadata
from elasticdl_strategy.transport.data_socket import DataSocketListener, FrameSocket
from elasticdl_strategy.transport.inbound import GrpcFrames, StreamReceiver, receive_messages
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.refusals import grpc_peer_host
from elasticdl_strategy.transport.shared_memory import ReceiveArena

logger = logging.getLogger(__name__)

SERVICE_NAME = "elasticdl_strategy.peer.Peer"
TRANSFER_METHOD = f"/{SERVICE_NAME}/Transfer"
ABORT_METHOD = f"/{SERVICE_NAME}/Abort"


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
        hello, arena, ticket, answer, watch = first.hello, None, None, None, None
        died: List[str] = []
        if hello.HasField("shared_memory") or hello.data_socket:
            answer = peer_pb2.TransferReply()
            if hello.HasField("shared_memory"):
                arena, answer.shared_memory_refusal = ReceiveArena.open(self._shared_memory_dir, hello.shared_memory)
                answer.shared_memory_accepted = arena is not None
                attach_lane = getattr(receiver, "attach_lane", None)  # receivers that read lanes have it
                if arena is not None and arena.lane is not None and attach_lane is not None:
                    attach_lane(arena.lane)
                    watch = arena.watch_sender(lambda: _ended_by_death(died, context, receiver))
            if hello.data_socket and self._data_sockets is not None:
                ticket = self._data_sockets.expect(source=grpc_peer_host(context.peer()))
                answer.data_socket_port, answer.data_socket_ticket = self._data_sockets.port, ticket
        error: Optional[str] = "the stream ended without a goodbye (the sender died or lost its connection)"
        goodbye = None
        try:
            if answer is not None:
                yield answer  # inside the try: if gRPC drops the call here, the cleanup below still runs
            source = GrpcFrames(frame_iterator, lambda: self._attach(ticket, context))
            goodbye = yield from receive_messages(source, receiver, arena)
            error = None
        except (grpc.RpcError, DataSocketClosed):
            error = "the connection broke (the sender died or the network failed)"
        except IncompleteStream:
            pass
        except Exception as e:  # a bug or a corrupt frame: the stream cannot continue
            logger.exception("receiving stream failed")
            error = f"receiving failed: {e!r}"
        finally:
            if watch is not None:
                watch.stop()
            if died:  # however the cancelled call ended (an error, the frames' end, the generator closed)
                error, goodbye = died[0], None
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


def _ended_by_death(died: List[str], context, receiver: StreamReceiver) -> None:
    """The sender's life mark says it died: the receiver is told (if it asks: ``sender_died``),
    and the stream ends now, with that reason."""
    sender_died = getattr(receiver, "sender_died", None)
    if sender_died is not None:
        sender_died()
    died.append("its process ended (its threads exited without closing the stream)")
    context.cancel()


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
