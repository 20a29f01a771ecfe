"""Point-to-point messaging between the ranks of one membership.

:class:`PointToPoint` owns one outbound ``Transfer`` stream per peer (opened on
first use) and the :class:`~elasticdl_strategy.collective.mailbox.Mailbox`
that matches incoming messages to receives. It is the layer the collectives
are built on, and is exposed to users as ``runtime.send`` / ``recv`` /
``isend`` / ``irecv``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import threading
import time
from concurrent import futures
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from elasticdl_strategy.collective.dtypes import as_supported_array, byte_view, dtype_name
from elasticdl_strategy.collective.mailbox import ArraySink, Key, Mailbox, Sink
from elasticdl_strategy.errors import (
    CollectiveTimeoutError,
    CommunicationError,
    CommunicatorClosedError,
    PeerFailureError,
    UsageError,
)
from elasticdl_strategy.transport import futex, lanes
from elasticdl_strategy.transport.data_socket import host_of
from elasticdl_strategy.transport.endpoints import open_channel
from elasticdl_strategy.transport.inbound import WAITING_THREAD_READS_AT_MOST, MessageWriter, SocketFrames
from elasticdl_strategy.transport.lanes import ReceiveLane
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.outbound import OutboundStream, OutgoingMessage, settle
from elasticdl_strategy.transport.peer_link import send_abort
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import SendArena

logger = logging.getLogger(__name__)

USER_CHANNEL = 0
COLLECTIVE_CHANNEL = 1
# A caller waiting for a message reads every lane at least this often (see _wait_reading).
SWEEP_S = 0.5
# A receive from a peer without a lane looks this often whether one appeared (its stream opened).
_NO_LANE_SLICE_S = 0.02
# A receive that found another thread reading its peer's data socket looks again after this long,
# then twice as long each time, up to _NO_LANE_SLICE_S (see _wait_without_lane).
_REFUSED_FIRST_RETRY_S = 100e-6
# A lane takes a message in one record up to a quarter of it, header included: about this much is headers.
_LANE_HEADER_ALLOWANCE = 1024
_DONE: futures.Future = futures.Future()  # the future of every send that completed in the caller
_DONE.set_result(None)


class Request:
    """A pending send or receive, as returned by ``isend`` and ``irecv``.

    Example::

        req = runtime.irecv(src=0, tag=7)
        ...                      # overlap other work
        array = req.wait(timeout=10)
    """

    def __init__(
        self,
        future: futures.Future,
        describe: Callable[[], str],
        peer: int,
        default_timeout: float,
        rank: int,
        cancel: Optional[Callable[[BaseException], bool]] = None,
        progress: Optional[Callable[[futures.Future, float], Any]] = None,
        poll: Optional[Callable[[], None]] = None,
    ):
        self._future = future
        self._cancel = cancel
        self._progress = progress  # waits for the future while reading the peer's lane (receives)
        self._poll = poll  # reads the peer's lane once, without waiting (receives)
        self._describe = describe
        self._peer = peer
        self._default_timeout = default_timeout
        self._rank = rank

    @property
    def peer(self) -> int:
        """The rank this request sends to or receives from."""
        return self._peer

    def done(self) -> bool:
        """True once the operation completed or failed; never blocks."""
        if self._poll is not None and not self._future.done():
            self._poll()  # a message in the peer's lane is only delivered by a reader
        return self._future.done()

    def succeeded(self) -> bool:
        """True once the operation completed without an error (a send into a lane, in ``isend``)."""
        future = self._future
        return future is _DONE or (future.done() and future.exception(0) is None)

    def wait(self, timeout: Optional[float] = None):
        """Waits for completion and returns the received array (``None`` for a send).

        Args:
            timeout: seconds; ``None`` means the communicator's default timeout.

        Raises:
            CollectiveTimeoutError: not complete within ``timeout``.
            PeerFailureError: the peer failed or left.
            CollectiveMismatchError: the message does not fit the receive buffer.
        """
        timeout = self._default_timeout if timeout is None else timeout
        try:
            if self._progress is not None and not self._future.done():
                return self._progress(self._future, timeout)
            return self._future.result(timeout=timeout)
        except futures.TimeoutError:
            raise self._timeout_error(timeout) from None

    def abandon(self, error: BaseException) -> None:
        """Fails the request with ``error`` unless it already completed (used when a collective aborts)."""
        settle(self._future, error)

    def cancel(self) -> bool:
        """Withdraws a receive that nothing has arrived for; returns whether it was withdrawn.

        The message it waited for goes to the next receive from the same rank and tag.
        """
        return self._cancel is not None and self._cancel(
            CommunicationError(f"rank {self._rank}: {self._describe()} was cancelled", rank=self._rank)
        )

    def _timeout_error(self, timeout: float) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"rank {self._rank}: {self._describe()} did not complete within {timeout:g}s "
            f"(waiting for rank {self._peer})",
            waiting_for=(self._peer,),
            rank=self._rank,
        )


def _describe_receive(src: int, tag: int) -> str:
    return f"receive from rank {src} (tag {tag})"


@functools.lru_cache(maxsize=1024)
def _header_of(channel: int, tag: int, nbytes: int, chunk_size: int, dtype, shape: tuple) -> peer_pb2.MessageHeader:
    """A message's header without its sequence number and collective descriptor; copied for each
    message (a third of the cost of building one)."""
    return peer_pb2.MessageHeader(
        channel=channel, tag=tag, nbytes=nbytes, chunk_size=chunk_size, dtype=dtype_name(dtype), shape=shape
    )


class _DirectReceive(Request):
    """A receive whose message may come by the sender's lane or data socket: the waiting caller
    reads the lane (or the socket) itself and puts the message straight into the receive's
    buffer (no mailbox entry, no future, no other thread). Only if it does not come that way
    within ``spin_us`` (or the caller asks :meth:`done` first) is the receive posted to the
    mailbox, and waited for as any.
    """

    def __init__(
        self,
        p2p: "PointToPoint",
        key: Key,
        sink: Sink,
        describe: Callable[[], str],
        take: Callable[[Key, Sink, float], bool],
    ):
        super().__init__(_DONE, describe, key[0], p2p.options.timeout_s, p2p.rank)
        self._p2p = p2p
        self._key: Optional[Key] = key  # reserved, not posted; None once posted or taken
        self._sink = sink
        self._take = take  # PointToPoint._take_from_lane or _take_from_socket
        self._taken = False  # the message came that way: the sink holds the result

    def done(self) -> bool:
        self._post()
        return super().done()

    def succeeded(self) -> bool:
        return self._key is None and super().succeeded()  # a reserved receive has received nothing yet

    def wait(self, timeout: Optional[float] = None):
        if self._taken:
            return self._sink.result()
        timeout = self._default_timeout if timeout is None else timeout
        key, self._key = self._key, None
        if key is not None:
            started = time.monotonic()
            try:
                if self._take(key, self._sink, timeout):
                    self._taken = True
                    return self._sink.result()
            except CommunicationError as e:  # the message was taken, and did not fit: it stays the answer
                self._future = futures.Future()
                self._future.set_exception(e)
                raise
            except BaseException:  # interrupted (Ctrl-C) while reading: the receive stays, posted
                self._key = key
                self._post()
                raise
            self._key = key
            self._post()
            timeout = max(0.0, timeout - (time.monotonic() - started))
        return super().wait(timeout)

    def abandon(self, error: BaseException) -> None:
        self._post()
        super().abandon(error)

    def cancel(self) -> bool:
        if self._key is not None:
            self._p2p.mailbox.give_back(self._key)
            self._key = None
            self._future = futures.Future()  # as a posted receive withdrawn: done, not succeeded
            self._future.set_exception(
                CommunicationError(f"rank {self._rank}: {self._describe()} was cancelled", rank=self._rank)
            )
            return True
        return super().cancel()

    def _post(self) -> None:
        """Hands the receive to the mailbox (its message then comes through it, by any path)."""
        if self._key is None:
            return
        p2p, key = self._p2p, self._key
        self._key = None
        self._future = p2p.mailbox.post_reserved(key, self._sink)
        self._cancel = lambda error: p2p.mailbox.cancel(key, error)
        self._progress = functools.partial(p2p._wait_reading, key[0], 0.0)
        self._poll = functools.partial(p2p._read_lane_of, key[0])


class PointToPoint:
    """Matched point-to-point messaging for one membership version.

    Args:
        rank: this process's rank.
        addresses: ``host:port`` of every rank's peer server, indexed by rank.
        membership_version: version of the membership these ranks come from.
        token: the job token.
        options: transport settings.
        worker_ids: the worker id of every rank, for error messages.

    Observers, set by the communicator and called from gRPC threads:
    ``header_observer(src, CollectiveDescriptor)`` for every collective message,
    ``abort_observer(AbortRequest)`` for every abort a peer sends, and
    ``failure_observer(peer_rank, reason, clean)`` the first time a peer's
    stream ends (``clean``: the peer closed its communicator on purpose).
    """

    def __init__(
        self,
        rank: int,
        addresses: Sequence[str],
        membership_version: int,
        token: str,
        options: TransportOptions,
        worker_id: str = "",
        worker_ids: Optional[Sequence[str]] = None,
    ):
        if not 0 <= rank < len(addresses):
            raise UsageError(f"rank {rank} is outside a membership of {len(addresses)} workers")
        self.rank = rank
        self.size = len(addresses)
        self.addresses = list(addresses)
        self.worker_ids = list(worker_ids) if worker_ids is not None else [""] * len(addresses)
        self.membership_version = membership_version
        self.options = options
        self._token = token
        self._worker_id = worker_id
        self.header_observer: Optional[Callable[[int, peer_pb2.CollectiveDescriptor], None]] = None
        self.abort_observer: Optional[Callable[[peer_pb2.AbortRequest], None]] = None
        self.failure_observer: Optional[Callable[[int, str, bool], None]] = None
        # Peers seen dead for certain: their process ended (their life mark, on this host).
        self.dead: Set[int] = set()
        self.mailbox = Mailbox(rank)
        # Reentrant: a stream to a dead peer can fail while it is being opened under the lock,
        # and its failure callback (peer_failed) then runs in this same thread.
        self._lock = threading.RLock()
        self._channels: Dict[int, grpc.Channel] = {}
        self._streams: Dict[int, OutboundStream] = {}
        self._send_sequence: Dict[tuple, int] = {}
        self._failed: Dict[int, str] = {}
        self._lanes: Dict[int, "_InboundStream"] = {}  # peers whose messages may arrive in a lane
        self._sockets: Dict[int, "_InboundStream"] = {}  # peers whose stream came over a data socket
        self._lanes_possible = options.shared_memory and options.shm_lane_bytes > 0 and futex.AVAILABLE
        # gRPC cancels a call whose future is garbage-collected: keep aborts alive until done.
        self._aborts_in_flight: set = set()
        self._closed = False
        self.bytes_sent = 0
        self.messages_sent = 0
        self.lane_messages_sent = 0  # of messages_sent, those written into a peer's lane

    # ---- sending --------------------------------------------------------------------------

    def isend(
        self,
        array: np.ndarray,
        dst: int,
        tag: int = 0,
        channel: int = USER_CHANNEL,
        collective: Optional[peer_pb2.CollectiveDescriptor] = None,
    ) -> Request:
        """Queues ``array`` for ``dst`` and returns at once.

        The array must not be modified until the request is done.
        """
        array = as_supported_array(array)
        self._check_peer(dst, "send to")
        payload = byte_view(array)
        with self._lock:
            seq_key = (dst, channel, tag)
            sequence = self._send_sequence.get(seq_key, 0)
            self._send_sequence[seq_key] = sequence + 1
        header = peer_pb2.MessageHeader()
        header.CopyFrom(_header_of(channel, tag, payload.nbytes, self.options.chunk_size, array.dtype, array.shape))
        header.sequence = sequence
        if collective is not None:
            header.collective.CopyFrom(collective)
        self.bytes_sent += payload.nbytes
        self.messages_sent += 1
        describe = lambda: f"send to rank {dst} (tag {tag})"  # noqa: E731
        if dst == self.rank:
            return self._send_to_self(header, payload, describe)
        stream = self._stream_to(dst)
        if stream.try_lane(header, payload):  # copied into the peer's lane: done
            self.lane_messages_sent += 1
            return Request(_DONE, describe, dst, self.options.timeout_s, self.rank)
        # While this thread waits to write, peers may wait to write to us: let our stream threads read.
        if stream.try_socket(header, payload, self._let_stream_threads_read):
            return Request(_DONE, describe, dst, self.options.timeout_s, self.rank)
        inline = payload.nbytes <= self.options.inline_threshold
        if inline:
            header.inline_data = payload.tobytes()
        message = OutgoingMessage(header, payload[:0] if inline else payload, header.chunk_size)
        stream.submit(message)
        return Request(message.future, describe, dst, self.options.timeout_s, self.rank)

    def _let_stream_threads_read(self) -> None:
        for src in list(self._sockets):
            socket = self._socket_of(src)
            if socket is not None:
                socket.hand_to_server()

    def _socket_of(self, src: int) -> Optional[SocketFrames]:
        """The data socket the stream from ``src`` reads, if it moved to one."""
        inbound = self._sockets.get(src)
        return inbound.socket if inbound is not None else None

    def send(self, array: np.ndarray, dst: int, tag: int = 0, timeout: Optional[float] = None) -> None:
        """Sends ``array`` to ``dst`` and returns once it has been handed to the transport."""
        self.isend(array, dst, tag).wait(timeout)

    def _send_to_self(self, header, payload: memoryview, describe) -> Request:
        writer = self.mailbox.deliver(self.rank, header)
        writer.write(0, memoryview(payload.tobytes()))
        writer.finish()
        return Request(_DONE, describe, self.rank, self.options.timeout_s, self.rank)

    @property
    def shared_memory_peers(self) -> List[int]:
        """Ranks whose stream from this rank carries payloads through shared memory."""
        return sorted(dst for dst, stream in list(self._streams.items()) if stream.uses_shared_memory)

    @property
    def data_socket_peers(self) -> List[int]:
        """Ranks whose stream from this rank goes over a direct data socket (its frames; its
        payloads too unless they go through shared memory)."""
        return sorted(dst for dst, stream in list(self._streams.items()) if stream.uses_data_socket)

    @property
    def shared_bytes_sent(self) -> int:
        """Payload bytes sent through shared memory (included in ``bytes_sent``)."""
        return sum(stream.shared_bytes_sent for stream in list(self._streams.values()))

    @property
    def bytes_received(self) -> int:
        """Payload bytes of messages this rank's receives have completed."""
        return self.mailbox.bytes_received

    @property
    def messages_received(self) -> int:
        return self.mailbox.messages_received

    # ---- receiving ------------------------------------------------------------------------

    def irecv(
        self,
        src: int,
        tag: int = 0,
        out: Optional[np.ndarray] = None,
        channel: int = USER_CHANNEL,
        sink: Optional[Sink] = None,
    ) -> Request:
        """Posts a receive of the next message from ``src`` with ``tag``; returns at once.

        With ``out``, the message is written into it (its size must match);
        otherwise a new array with the sender's dtype and shape is returned.
        """
        self._check_peer(src, "receive from", allow_failed=True)
        if out is not None and (not isinstance(out, np.ndarray) or not out.flags.c_contiguous):
            raise UsageError("out must be a C-contiguous numpy array")
        sink = sink or ArraySink(self.rank, out)
        describe = functools.partial(_describe_receive, src, tag)
        take = self._direct_take(src, sink)
        if take is not None:
            key = self.mailbox.reserve(src, channel, tag)
            if key is not None:
                return _DirectReceive(self, key, sink, describe, take)
        self._read_lane_of(src)  # what already arrived in its lane, before the receive is posted
        future, key = self.mailbox.post(src, channel, tag, sink)
        progress = poll = None
        if self._lanes_possible or self.options.data_socket:
            progress = functools.partial(self._wait_reading, src, self._spins_for(sink))
        if self._lanes_possible:
            poll = functools.partial(self._read_lane_of, src)
        return Request(
            future,
            describe,
            src,
            self.options.timeout_s,
            self.rank,
            cancel=lambda error: self.mailbox.cancel(key, error),
            progress=progress,
            poll=poll,
        )

    def _read_lane_of(self, src: int) -> None:
        inbound = self._lanes.get(src)
        if inbound is not None:
            inbound.read_lane()

    def _fits_lane(self, sink: Sink) -> bool:
        """Whether the message ``sink`` takes may come by a lane (a size known to fit one)."""
        expected = sink.expected_nbytes
        return expected is not None and expected <= self.options.shm_lane_bytes // 4 - _LANE_HEADER_ALLOWANCE

    def _spins_for(self, sink: Sink) -> float:
        """How long to spin for a message ``sink`` takes: ``spin_us`` if it may come by a lane (in
        pieces too), else 0 (a spinning caller holds the GIL that the stream's thread needs to
        deliver a large message)."""
        expected = sink.expected_nbytes
        if expected is not None and expected > lanes.max_message_bytes(self.options.shm_lane_bytes):
            return 0.0
        return self.options.spin_us * 1e-6

    def _direct_take(self, src: int, sink: Sink) -> Optional[Callable[[Key, Sink, float], bool]]:
        """How a waiting caller may take the message ``sink`` takes from ``src`` itself: from its lane
        if it fits one, from its data socket where there is no lane if a waiting caller reads it
        (not larger than :data:`~.inbound.WAITING_THREAD_READS_AT_MOST`: a caller spinning for a
        larger one would hold the GIL the stream's thread needs to read it); None: through the mailbox."""
        if src in self._lanes:
            return self._take_from_lane if self._fits_lane(sink) else None
        expected = sink.expected_nbytes
        if src in self._sockets and self.options.spin_us > 0 and (expected or 0) <= WAITING_THREAD_READS_AT_MOST:
            return self._take_from_socket
        return None

    def _take_from_socket(self, key: Key, sink: Sink, timeout: float) -> bool:
        """Reads ``key``'s sender's data socket in this thread until the message ``key`` comes out of
        it (written into ``sink``: True), for at most ``spin_us`` (and ``timeout``); False when it has
        not come by then or came another way: then the receive is posted."""
        inbound = self._sockets.get(key[0])
        seconds = min(timeout, self.options.spin_us * 1e-6)
        return inbound is not None and inbound.take_from_socket(key, sink, seconds, self.options.spin_yield)

    def _take_from_lane(self, key: Key, sink: Sink, timeout: float) -> bool:
        """Reads the lane of ``key``'s sender in this thread until the message ``key`` comes out of it
        (written into ``sink``: True), for at most ``spin_us`` (and ``timeout``); False when it has
        not come by then, came another way, or the lane went: then the receive is posted.

        Raises:
            CommunicationError: the message does not fit ``sink`` (a mismatch).
        """
        give_up = time.monotonic() + min(timeout, self.options.spin_us * 1e-6)
        while True:
            inbound = self._lanes.get(key[0])
            taken = inbound.take(key, sink) if inbound is not None else False
            if taken is not None:
                return taken
            if self.mailbox.arrived(key) or time.monotonic() >= give_up:
                return False
            if self.options.spin_yield:
                os.sched_yield()

    def recv(
        self, src: int, tag: int = 0, out: Optional[np.ndarray] = None, timeout: Optional[float] = None
    ) -> np.ndarray:
        """Receives the next message from ``src`` with ``tag``; see :meth:`irecv`.

        On timeout the receive is withdrawn, so a later ``recv`` gets the message.
        """
        request = self.irecv(src, tag, out)
        try:
            return request.wait(timeout)
        except CollectiveTimeoutError:
            request.cancel()
            raise

    def _wait_reading(self, src: int, spin_s: float, future: futures.Future, timeout: float):
        """Waits for a receive from ``src``, reading ``src``'s lane, or else its data socket, in this
        thread meanwhile.

        On a lane it looks again and again for ``spin_s``, then sleeps on the lane's doorbell,
        which the sender rings after each message and this process when the receive completes
        another way (its message came on the stream, or the stream ended and failed it). Every
        :data:`SWEEP_S` it also reads every other lane: a message nobody waits for is then
        delivered, and its collective descriptor checked (a rank that called another collective
        is found out by what it sends, which may sit in a lane no receive reads).

        Raises:
            futures.TimeoutError: not complete within ``timeout``.
        """
        now = time.monotonic()
        deadline, spin_until, sweep_at = now + timeout, now + spin_s, now + SWEEP_S
        rings_on_completion = wakes_socket_reader = False
        retry_s = _REFUSED_FIRST_RETRY_S
        while not future.done():
            now = time.monotonic()
            if now >= deadline:
                raise futures.TimeoutError()
            if now >= sweep_at:
                self.sweep_lanes()
                sweep_at = now + SWEEP_S
            inbound = self._lanes.get(src)
            lane = inbound.lane if inbound is not None else None
            if lane is None:
                if not wakes_socket_reader:  # once: a peer with a lane never needs it
                    future.add_done_callback(functools.partial(self._wake_socket_reader, src))
                    wakes_socket_reader = True
                retry_s = self._wait_without_lane(src, future, min(deadline, sweep_at), retry_s)
                continue
            seen = lane.doorbell
            inbound.read_lane()  # type: ignore[union-attr]
            if future.done():
                continue
            if now < spin_until:
                if self.options.spin_yield:
                    os.sched_yield()
                continue
            if not rings_on_completion:
                future.add_done_callback(functools.partial(_ring, lane))
                rings_on_completion = True
                continue  # look once more: it may have completed before the callback was added
            lane.wait(seen, max(0.0, min(deadline, sweep_at) - now))
        return future.result(0)

    def _wait_without_lane(self, src: int, future: futures.Future, until: float, retry_s: float) -> float:
        """Waits for ``future`` up to ``until`` (``time.monotonic()``) at most, reading ``src``'s data
        socket in this thread if it has one that no other thread reads, else on the future for
        ``retry_s`` (a stream that opens meanwhile brings a lane or a socket its messages may come
        by). Returns how long to wait on the future the next time the socket is not this thread's.
        ``future`` must wake the socket's reader when done (:meth:`_wake_socket_reader`).

        The socket may be refused for a moment only: the stream's thread holds it while it looks
        for something to read, and when it finds nothing it leaves the socket to waiting threads
        (:data:`~.inbound._READERS_GRACE_S`) and watches only for their news. A message that comes
        then is read by nobody until this thread looks again, so it looks again soon, and less
        often the longer another thread reads (a thread of the caller's waiting for its own message).
        """
        inbound = self._sockets.get(src)
        socket = inbound.socket if inbound is not None else None
        waiting = lambda: not future.done()  # noqa: E731
        spin_s, spin_yield = self.options.spin_us * 1e-6, self.options.spin_yield
        if socket is not None and socket.read_while(inbound, waiting, until, spin_s, spin_yield):  # type: ignore[arg-type]
            return _REFUSED_FIRST_RETRY_S
        slice_s = retry_s if socket is not None else _NO_LANE_SLICE_S
        try:
            future.result(max(0.0, min(until - time.monotonic(), slice_s)))
        except futures.TimeoutError:
            pass
        return min(2 * retry_s, _NO_LANE_SLICE_S)

    def sweep_lanes(self) -> None:
        for inbound in list(self._lanes.values()):
            inbound.read_lane()

    def _wake_socket_reader(self, src: int, _future: futures.Future) -> None:
        socket = self._socket_of(src)
        if socket is not None:
            socket.wake_reader()

    # ---- the StreamListener side, called by the worker server -----------------------------

    def open_stream(self, hello: peer_pb2.StreamHello) -> "_InboundStream":
        if hello.membership_version != self.membership_version:
            raise ValueError(
                f"stream from membership version {hello.membership_version}, "
                f"this worker is at {self.membership_version}"
            )
        if not 0 <= hello.src_rank < self.size or hello.src_rank == self.rank:
            raise ValueError(f"stream from invalid rank {hello.src_rank} (size {self.size})")
        return _InboundStream(self, hello.src_rank)

    # ---- failures -------------------------------------------------------------------------

    def peer_failed(self, peer: int, reason: str, clean: bool = False) -> None:
        """Marks ``peer`` as gone: its incomplete and later receives raise PeerFailureError, and
        (unless it left ``clean``ly) so do the unsent and later sends to it."""
        with self._lock:
            if peer in self._failed or self._closed:
                return
            self._failed[peer] = reason
        if not clean:
            logger.warning("%s failed: %s", self.describe_peer(peer), reason)
            stream = self._streams.get(peer)
            if stream is not None:  # sends to it fail now, not when that connection notices
                stream.fail(reason)
            socket = self._socket_of(peer)
            if socket is not None:  # a hung sender may stop mid-message
                socket.shutdown()
        self.mailbox.fail_source(peer, lambda: self._peer_error(peer))
        if self.failure_observer is not None:
            self.failure_observer(peer, reason, clean)

    def on_abort(self, request: peer_pb2.AbortRequest) -> None:
        if self.abort_observer is not None and 0 <= request.src_rank < self.size:
            self.abort_observer(request)

    def raise_if_failed(self, peers: Sequence[int]) -> None:
        """Raises PeerFailureError for the first of ``peers`` that failed or left."""
        for peer in peers:
            if peer in self._failed:
                raise self._peer_error(peer)

    def describe_peer(self, peer: int) -> str:
        """``rank 2 (worker-1 at 10.0.0.3:4000)``, for error messages."""
        name = f"{self.worker_ids[peer]} at " if self.worker_ids[peer] else ""
        return f"rank {peer} ({name}{self.addresses[peer]})"

    def _peer_error(self, peer: int) -> PeerFailureError:
        return PeerFailureError(
            f"rank {self.rank}: {self.describe_peer(peer)} failed: {self._failed.get(peer, 'unknown')}",
            peer_rank=peer,
            rank=self.rank,
        )

    def _check_peer(self, peer: int, what: str, allow_failed: bool = False) -> None:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise UsageError(f"cannot {what} rank {peer!r}: ranks are 0..{self.size - 1}")
        if self._closed:
            raise CommunicatorClosedError(f"rank {self.rank}: the communicator is shut down", rank=self.rank)
        if peer in self._failed and not allow_failed:
            raise self._peer_error(peer)

    def send_abort(self, kind: str, reason: str, ranks: Sequence[int]) -> None:
        """Tells every live peer that the current collective failed (best effort, no waiting)."""
        request = peer_pb2.AbortRequest(
            src_rank=self.rank, membership_version=self.membership_version, kind=kind, reason=reason, ranks=list(ranks)
        )
        for peer in range(self.size):
            if peer != self.rank and peer not in self._failed:
                try:
                    call = send_abort(self._channel_to(peer), self._token, request, self.options.connect_timeout_s)
                    self._aborts_in_flight.add(call)
                    call.add_done_callback(self._aborts_in_flight.discard)
                except Exception:  # the peer may be gone; it learns of the abort another way
                    logger.debug("abort to rank %d not sent", peer, exc_info=True)

    # ---- streams and shutdown -------------------------------------------------------------

    def _channel_to(self, peer: int) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(peer)
            if channel is None:
                channel = open_channel(self.addresses[peer], self.options)
                self._channels[peer] = channel
            return channel

    def _stream_to(self, dst: int) -> OutboundStream:
        stream = self._streams.get(dst)
        if stream is None:
            channel = self._channel_to(dst)
            with self._lock:
                stream = self._streams.get(dst)
                if stream is None:
                    hello = peer_pb2.StreamHello(
                        src_rank=self.rank, membership_version=self.membership_version, worker_id=self._worker_id
                    )
                    stream = OutboundStream(
                        channel,
                        hello,
                        self._token,
                        dst,
                        lambda reason: self.peer_failed(dst, reason),
                        self._arena(),
                        data_host=host_of(self.addresses[dst]) if self.options.data_socket else None,
                        options=self.options,
                    )
                    self._streams[dst] = stream
        return stream

    def _arena(self) -> Optional[SendArena]:
        """A shared-memory arena to offer a peer, or ``None`` (disabled, or no usable directory)."""
        if not self.options.shared_memory:
            return None
        lane_bytes = self.options.shm_lane_bytes if self._lanes_possible else 0
        try:
            return SendArena(
                self.options.shared_memory_dir, self.options.shm_slots, self.options.shm_slot_size, lane_bytes
            )
        except OSError as e:
            logger.debug("no shared-memory arena (%s); sending over gRPC", e)
            return None

    def close(self, timeout: float = 5.0, abort: Optional[peer_pb2.AbortRequest] = None) -> None:
        """Flushes and ends every stream, then closes the channels. Idempotent.

        ``abort``, when the collectives had failed, travels in the goodbye so
        that peers report the original error rather than this rank leaving.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams, channels = list(self._streams.values()), list(self._channels.values())
        deadline = time.monotonic() + timeout
        # Aborts first: a peer must learn why before it sees this rank leave.
        for call in list(self._aborts_in_flight):
            try:
                call.result(timeout=max(0.0, deadline - time.monotonic()))
            except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
                pass  # that peer is gone or slow; it learns of the failure another way
        goodbye = peer_pb2.Goodbye(reason="closed", abort=abort)
        for stream in streams:
            stream.close(timeout=max(0.1, deadline - time.monotonic()), goodbye=goodbye)
        for channel in channels:
            channel.close()
        closed = lambda: CommunicatorClosedError(f"rank {self.rank}: the communicator is shut down", rank=self.rank)  # noqa: E731
        self.mailbox.fail_channel(USER_CHANNEL, closed)
        self.mailbox.fail_channel(COLLECTIVE_CHANNEL, closed)


def _ring(lane: ReceiveLane, _future: futures.Future) -> None:
    lane.ring()


@dataclasses.dataclass
class _Pieces:
    """A message arriving in pieces from a lane: where its bytes go, how many came."""

    writer: MessageWriter
    received: int
    nbytes: int


class _Taking(enum.Enum):
    WAITING = "waiting"  # for its header
    READING = "reading"  # its payload, into the sink
    TAKEN = "taken"  # all of it, into the sink
    PASSED = "passed"  # to the mailbox: the posted receive gets it (or its error)


class _AwaitedOnSocket:
    """The message a thread reading a data socket waits for, and where it goes once its header came
    (:meth:`place`): into the receive's sink if it fits, else to the mailbox."""

    __slots__ = ("key", "sink", "state", "_inbound", "_mailbox", "_nbytes")

    def __init__(self, key: Key, sink: Sink, inbound: "_InboundStream"):
        self.key = key
        self.sink = sink
        self.state = _Taking.WAITING
        self._inbound = inbound
        self._mailbox = inbound.mailbox
        self._nbytes = 0

    def waiting(self) -> bool:
        """Whether the message has not come yet: neither here nor (read by another thread) to the mailbox."""
        return self.state is _Taking.WAITING and not self._mailbox.arrived(self.key)

    def stop_waiting(self) -> None:
        """Ends the wait here (the receive waits on, posted): :meth:`waiting` is false from now on."""
        if self.state is _Taking.WAITING:
            self.state = _Taking.PASSED

    def place(self, header: peer_pb2.MessageHeader) -> Optional[MessageWriter]:
        """The writer of the message of ``header`` if it is the awaited one (``place`` of
        :meth:`SocketFrames.read_while`): this object, whose payload goes into the sink, if it fits
        the sink; else the mailbox's (whose posted receive then fails with the reason). None,
        changing nothing, for any other message, and for this one once it is no longer awaited."""
        key = self.key  # its sender, key[0], is the stream's: only the channel, tag and number differ
        if header.sequence != key[3] or header.channel != key[1] or header.tag != key[2]:
            return None
        if self.state is not _Taking.WAITING:
            return None
        self._inbound.observe(header)
        self.state = _Taking.PASSED
        if self._mailbox.channel_failed(header.channel):
            return self._mailbox.deliver(key[0], header)
        try:
            self.sink.begin(key[0], header)
        except CommunicationError:  # the mailbox fails the posted receive with it
            return self._mailbox.deliver(key[0], header)
        self.state, self._nbytes = _Taking.READING, header.nbytes
        return self

    def write(self, offset: int, data: memoryview, borrowed: bool = False) -> None:
        self.sink.write(offset, data)

    def target(self, offset: int, nbytes: int) -> Optional[memoryview]:
        return self.sink.target(offset, nbytes)

    def target_done(self) -> None:
        pass

    def finish(self) -> None:
        self.state = _Taking.TAKEN
        self._mailbox.count(self._nbytes)


class _InboundStream:
    """Receives one peer's stream into the mailbox (StreamReceiver protocol), and its lane when
    the stream has one: read by whichever thread waits for a message from that peer."""

    def __init__(self, p2p: PointToPoint, src: int):
        self._p2p = p2p
        self._src = src
        self.socket: Optional[SocketFrames] = None  # the stream's data socket, once it moved there
        self.lane: Optional[ReceiveLane] = None
        self._lane_lock = threading.Lock()  # one reader at a time; guards the lane and _pieces
        self._pieces: Optional[_Pieces] = None  # the message whose pieces are being read from the lane
        self.mailbox = p2p.mailbox

    def on_header(self, header: peer_pb2.MessageHeader):
        self.observe(header)
        return self.mailbox.deliver(self._src, header)

    def observe(self, header: peer_pb2.MessageHeader) -> None:
        """Shows the descriptor of a collective message to the communicator (which checks it)."""
        p2p = self._p2p
        if header.channel == COLLECTIVE_CHANNEL and p2p.header_observer is not None:
            p2p.header_observer(self._src, header.collective)

    def take_from_socket(self, key: Key, sink: Sink, seconds: float, spin_yield: bool) -> bool:
        """Reads the data socket in this thread for up to ``seconds`` (spinning, never asleep) until
        the message ``key`` came, straight into ``sink`` (True); delivers every other message to
        the mailbox. False when it has not come by then, went to the mailbox (it does not fit
        ``sink``, or the collectives aborted: the posted receive then fails with the reason),
        another thread reads the socket, or the stream has no socket."""
        socket = self.socket
        if socket is None or seconds <= 0:
            return False
        awaited = _AwaitedOnSocket(key, sink, self)
        try:
            socket.read_while(self, awaited.waiting, time.monotonic() + seconds, seconds, spin_yield, awaited.place)
        finally:
            awaited.stop_waiting()
        return awaited.state is _Taking.TAKEN

    def attach_lane(self, lane: ReceiveLane) -> None:
        self.lane = lane
        self._p2p._lanes[self._src] = self

    def attach_socket(self, socket: SocketFrames) -> None:
        self.socket = socket
        self._p2p._sockets[self._src] = self

    def read_lane(self) -> None:
        """Delivers every message waiting in the lane to the mailbox (a message in pieces: the
        pieces written so far)."""
        with self._lane_lock:
            while (record := self._next_record()) is not None:
                header, payload, end = record
                if header is None:
                    self._continue(payload, end)
                else:
                    self._deliver(header, payload, end)

    def _next_record(self) -> Optional[Tuple[Optional[peer_pb2.MessageHeader], memoryview, int]]:
        """The lane's next record with its header parsed (None for a piece), or None when the lane
        is empty or gone (it goes when it holds something that is not a message)."""
        lane = self.lane
        if lane is None:
            return None
        try:
            record = lane.next_record()
            if record is None:
                return None
            header_bytes, payload, end = record
            if (header_bytes is None) != (self._pieces is not None):
                raise ValueError("a piece without its message" if header_bytes is None else "a message cut short")
            header = None if header_bytes is None else peer_pb2.MessageHeader.FromString(header_bytes)
            if header is not None and len(payload) > header.nbytes:
                raise ValueError(f"{len(payload)} bytes for a message of {header.nbytes}")
        except (ValueError, DecodeError) as e:
            self._lane_corrupt(e)
            return None
        return header, payload, end

    def _deliver(self, header: peer_pb2.MessageHeader, payload: memoryview, end: int) -> None:
        """Hands a lane record to the mailbox: a whole message, or the first piece of one."""
        writer = self.on_header(header)
        if len(payload):
            writer.write(0, payload, borrowed=True)
        self.lane.release(end)  # type: ignore[union-attr]
        if len(payload) < header.nbytes:
            self._pieces = _Pieces(writer, len(payload), header.nbytes)
        else:
            writer.finish()

    def _continue(self, payload: memoryview, end: int) -> None:
        """Hands the next piece of the message in pieces to the mailbox."""
        pieces = self._pieces
        assert pieces is not None  # checked by _next_record
        if pieces.received + len(payload) > pieces.nbytes:
            self._lane_corrupt(ValueError(f"pieces beyond the message's {pieces.nbytes} bytes"))
            return
        pieces.writer.write(pieces.received, payload, borrowed=True)
        self.lane.release(end)  # type: ignore[union-attr]
        pieces.received += len(payload)
        if pieces.received == pieces.nbytes:
            self._pieces = None
            pieces.writer.finish()

    def _lane_corrupt(self, error: Exception) -> None:
        """The arena holds something that is not a message: the stream cannot be trusted."""
        self.lane = None
        self._p2p.peer_failed(self._src, f"its lane holds something that is not a message ({error})")

    def take(self, key: Key, sink: Sink) -> Optional[bool]:
        """Reads the lane's next record: True if it is the message ``key`` (written into ``sink``);
        None if the lane is empty or the record was another message or a piece of one (delivered
        to the mailbox); False if the lane is gone, the message cannot be handed over (the
        collectives aborted: the posted receive then fails with the reason) or it comes in pieces
        (left in the lane: the posted receive gets them through the mailbox as they come).

        Raises:
            CommunicationError: the message does not fit ``sink`` (a mismatch).
        """
        with self._lane_lock:
            record = self._next_record()
            if record is None:
                return None if self.lane is not None else False
            header, payload, end = record
            if header is None:
                self._continue(payload, end)
                return None
            if (self._src, header.channel, header.tag, header.sequence) != key:
                self._deliver(header, payload, end)
                return None
            if len(payload) < header.nbytes:
                return False  # in pieces: through the mailbox once the receive is posted (the record stays)
            lane = self.lane
            assert lane is not None
            mailbox = self.mailbox
            try:
                self.observe(header)
                if mailbox.channel_failed(header.channel):
                    return False
                sink.begin(self._src, header)
                if len(payload):
                    sink.write(0, payload)
            finally:
                lane.release(end)
            mailbox.count(header.nbytes)
            return True

    def _detach_lane(self) -> None:
        """The stream ended: reads what its lane still holds, then lets go of it (waiters are woken;
        a message whose pieces stopped coming fails with the stream)."""
        self.read_lane()
        with self._lane_lock:
            lane, self.lane = self.lane, None
            self._pieces = None
        if self._p2p._lanes.get(self._src) is self:
            del self._p2p._lanes[self._src]
        if lane is not None:
            lane.ring()

    def sender_died(self) -> None:
        """The sender's process ended (seen through its life mark): before its stream is closed."""
        self._p2p.dead.add(self._src)

    def on_closed(self, error: Optional[str], goodbye: Optional[peer_pb2.Goodbye]) -> None:
        self._detach_lane()
        if self._p2p._sockets.get(self._src) is self:
            del self._p2p._sockets[self._src]
        if error is not None:
            self._p2p.peer_failed(self._src, error)
            return
        if goodbye is not None and goodbye.HasField("abort"):
            self._p2p.on_abort(goodbye.abort)
        else:
            self._p2p.peer_failed(self._src, "it closed its communicator (shut down or left)", clean=True)
