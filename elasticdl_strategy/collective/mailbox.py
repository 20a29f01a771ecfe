"""Matching of incoming messages to receives, by (sender, channel, tag, sequence).

Each sender numbers its messages per (receiver, channel, tag); each receive
takes the next number for its (sender, channel, tag). A message that arrives
before its receive is posted is kept (as the received frames, without copying,
or as a copy of the shared-memory slots that carried it) until the receive
claims it; a receive posted first gets the bytes written straight into its
:class:`Sink` as the chunks arrive, which for reductions
means the data is reduced while the rest is still on the wire.
"""

from __future__ import annotations

import collections
import heapq
import threading
from concurrent import futures
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from elasticdl_strategy.collective.dtypes import byte_view, dtype_from_name
from elasticdl_strategy.errors import CollectiveMismatchError, CommunicationError
from elasticdl_strategy.transport.protos import peer_pb2

Key = Tuple[int, int, int, int]  # (src, channel, tag, sequence)


class Sink:
    """Where the bytes of one received message go.

    ``begin`` sees the header before any byte and may reject it by raising
    :class:`CommunicationError`; ``write`` stores a chunk at its byte offset;
    ``result`` is what the receive returns. A sink that only stores bytes
    may also offer ``target``: where the transport can read them directly.
    """

    def begin(self, src: int, header: peer_pb2.MessageHeader) -> None:
        raise NotImplementedError

    def write(self, offset: int, data: memoryview) -> None:
        raise NotImplementedError

    def target(self, offset: int, nbytes: int) -> Optional[memoryview]:
        """A writable view of bytes ``offset .. offset + nbytes`` of the result, or ``None``
        when bytes must go through :meth:`write` (a reduction)."""
        return None

    def result(self):
        return None

    @property
    def expected_nbytes(self) -> Optional[int]:
        """The size of the message this sink takes, when known before it arrives."""
        return None


class ArraySink(Sink):
    """Receives into ``out`` (checked against the message) or into a new array shaped by the header."""

    def __init__(self, rank: int, out: Optional[np.ndarray] = None):
        self._rank = rank
        self._out = out
        self._bytes: Optional[memoryview] = None

    def begin(self, src: int, header: peer_pb2.MessageHeader) -> None:
        if self._out is None:
            self._out = np.empty(tuple(header.shape), dtype_from_name(header.dtype))
        elif self._out.nbytes != header.nbytes:
            raise CollectiveMismatchError(
                f"rank {self._rank}: the message from rank {src} holds {header.nbytes} bytes "
                f"(dtype {header.dtype}, shape {tuple(header.shape)}) but the receive buffer holds "
                f"{self._out.nbytes} (dtype {self._out.dtype}, shape {self._out.shape})",
                ranks=(src, self._rank),
                rank=self._rank,
            )
        self._bytes = byte_view(self._out)

    def write(self, offset: int, data: memoryview) -> None:
        self._started()[offset : offset + len(data)] = memoryview(data).cast("B")

    def target(self, offset: int, nbytes: int) -> Optional[memoryview]:
        return self._started()[offset : offset + nbytes]

    def result(self) -> np.ndarray:
        assert self._out is not None, "a receive completes after its header"
        return self._out

    @property
    def expected_nbytes(self) -> Optional[int]:
        return self._out.nbytes if self._out is not None else None

    def _started(self) -> memoryview:
        assert self._bytes is not None, "bytes arrive after the header (begin)"
        return self._bytes


class ReduceSink(Sink):
    """Reduces incoming elements into the 1-D array ``acc`` in place: ``acc = ufunc(acc, incoming)``."""

    def __init__(self, rank: int, acc: np.ndarray, ufunc: Callable):
        self._rank = rank
        self._acc = acc
        self._ufunc = ufunc

    def begin(self, src: int, header: peer_pb2.MessageHeader) -> None:
        if header.nbytes != self._acc.nbytes:
            raise CollectiveMismatchError(
                f"rank {self._rank}: rank {src} sent a {header.nbytes}-byte segment where "
                f"{self._acc.nbytes} bytes were expected",
                ranks=(src, self._rank),
                rank=self._rank,
            )

    @property
    def expected_nbytes(self) -> Optional[int]:
        return self._acc.nbytes

    def write(self, offset: int, data: memoryview) -> None:
        itemsize = self._acc.itemsize
        start = offset // itemsize
        incoming = np.frombuffer(data, self._acc.dtype)
        part = self._acc[start : start + len(incoming)]
        self._ufunc(part, incoming, out=part)


class _Entry:
    """One message, from arrival or posting to completion."""

    __slots__ = (
        "src", "channel", "lock", "header", "sink", "buffered", "arrived", "future", "on_complete", "lent", "failure"
    )  # fmt: skip

    def __init__(self, src: int, channel: int, on_complete: Callable[[int], None]):
        self.on_complete = on_complete
        self.src = src
        self.channel = channel
        self.lock = threading.Lock()
        self.header: Optional[peer_pb2.MessageHeader] = None
        self.sink: Optional[Sink] = None
        self.buffered: List[Tuple[int, memoryview]] = []
        self.arrived = False  # every byte has been received
        self.future: futures.Future = futures.Future()
        self.lent = 0  # views from target() that the transport is still reading into
        # A failure that waits for those views to come back before it completes the future: until
        # then bytes may still land in the receive's buffer, which the caller must not reuse yet.
        self.failure: Optional[BaseException] = None

    def _ended(self) -> bool:
        return self.future.done() or self.failure is not None

    # Called by the stream receiver (MessageWriter protocol).
    def write(self, offset: int, data: memoryview, borrowed: bool = False) -> None:
        with self.lock:
            if self._ended():
                return  # failed: drop the rest of the message
            if self.sink is None:
                # A borrowed view (a shared-memory slot) is reused once this returns.
                self.buffered.append((offset, memoryview(bytes(data)) if borrowed else data))
            else:
                self._apply(self.sink.write, offset, data)

    def target(self, offset: int, nbytes: int) -> Optional[memoryview]:
        """Where the transport may read bytes ``offset .. offset + nbytes`` straight into
        (the receive's own buffer), or ``None``: then they go through :meth:`write`.

        Only offered while the receive is posted and pending; call :meth:`target_done`
        once the transport stops reading into the view. A receive that fails meanwhile
        completes only then, so no byte lands in a buffer whose receive has returned.
        """
        with self.lock:
            if self.sink is None or self._ended():
                return None
            view = self.sink.target(offset, nbytes)
            if view is not None:
                self.lent += 1
            return view

    def target_done(self) -> None:
        """The transport stopped reading into a view from :meth:`target` (filled, or its connection broke)."""
        with self.lock:
            self.lent -= 1
            if self.lent == 0 and self.failure is not None and not self.future.done():
                self.future.set_exception(self.failure)

    def finish(self) -> None:
        with self.lock:
            self.arrived = True
            self._complete_if_ready()

    def set_header(self, header: peer_pb2.MessageHeader) -> None:
        with self.lock:
            self.header = header
            if self.sink is not None:
                self._apply(self.sink.begin, self.src, header)

    def attach(self, sink: Sink) -> None:
        with self.lock:
            self.sink = sink
            if self.header is not None:
                self._apply(sink.begin, self.src, self.header)
                for offset, data in self.buffered:
                    self._apply(sink.write, offset, data)
                self.buffered = []
            self._complete_if_ready()

    def fail(self, error: BaseException) -> bool:
        with self.lock:
            if self._ended():
                return False
            self._set_failure(error)
            return True

    def _set_failure(self, error: BaseException) -> None:
        self.buffered = []
        if self.lent:
            self.failure = error  # completed by target_done
        else:
            self.future.set_exception(error)

    def _apply(self, action: Callable, *args) -> None:
        if self._ended():
            return
        try:
            action(*args)
        except CommunicationError as e:
            self._set_failure(e)

    def _complete_if_ready(self) -> None:
        if self.arrived and self.sink is not None and self.header is not None and not self._ended():
            self.on_complete(self.header.nbytes)
            self.future.set_result(self.sink.result())


class Mailbox:
    """Pairs messages with receives; fails receives when a peer or a channel fails.

    Thread-safe: stream receivers deliver from gRPC threads while callers post.
    """

    def __init__(self, rank: int):
        self._rank = rank
        self._lock = threading.Lock()
        self._next_sequence: Dict[Tuple[int, int, int], int] = collections.defaultdict(int)
        # Sequence numbers given back by cancelled receives, reused smallest first.
        self._released: Dict[Tuple[int, int, int], List[int]] = collections.defaultdict(list)
        self._unmatched: Dict[Key, _Entry] = {}
        self._posted: Dict[Key, _Entry] = {}
        self._failed_sources: Dict[int, Callable[[], BaseException]] = {}
        self._failed_channels: Dict[int, Callable[[], BaseException]] = {}
        # Payload of messages delivered to completed receives (not of messages merely arrived).
        self.bytes_received = 0
        self.messages_received = 0

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.messages_received += 1

    def post(self, src: int, channel: int, tag: int, sink: Sink) -> Tuple[futures.Future, Key]:
        """Posts a receive of the next message from ``src`` on (channel, tag).

        Returns:
            a future with ``sink.result()`` (or the error that failed it), and the message key.
        """
        with self._lock:
            seq_key = (src, channel, tag)
            released = self._released.get(seq_key)
            if released:
                sequence = heapq.heappop(released)
            else:
                sequence = self._next_sequence[seq_key]
                self._next_sequence[seq_key] += 1
        key = (src, channel, tag, sequence)
        return self.post_reserved(key, sink), key

    def reserve(self, src: int, channel: int, tag: int) -> Optional[Key]:
        """Takes the key of the next receive from ``src`` on (channel, tag) for a caller that reads
        its message from a lane itself; it then counts it (:meth:`count`), or posts the receive
        (:meth:`post_reserved`) when the message comes another way (or not soon).

        Returns:
            the key, or None (nothing taken: :meth:`post` instead) when that message has begun to
            arrive, a cancelled receive gave a number back, or the source or the channel failed.
        """
        with self._lock:
            seq_key = (src, channel, tag)
            if self._released.get(seq_key) or src in self._failed_sources or channel in self._failed_channels:
                return None
            key = (src, channel, tag, self._next_sequence[seq_key])
            if key in self._unmatched:
                return None
            self._next_sequence[seq_key] += 1
            return key

    def arrived(self, key: Key) -> bool:
        """Whether the message ``key`` has begun to arrive without a posted receive."""
        return key in self._unmatched  # one dict lookup: atomic under the GIL

    def channel_failed(self, channel: int) -> bool:
        return channel in self._failed_channels

    def give_back(self, key: Key) -> None:
        """A reserved receive was withdrawn: its number goes to the next receive on its (src, channel, tag)."""
        with self._lock:
            heapq.heappush(self._released[key[:3]], key[3])

    def count(self, nbytes: int) -> None:
        """A reserved receive got its message of ``nbytes`` from a lane."""
        self._count(nbytes)

    def post_reserved(self, key: Key, sink: Sink) -> futures.Future:
        """Posts the receive of ``key`` (from :meth:`reserve`); returns its future, as :meth:`post`."""
        src, channel = key[0], key[1]
        with self._lock:
            entry = self._unmatched.pop(key, None)
            channel_error = self._failed_channels.get(channel)
            if entry is None:
                entry = _Entry(src, channel, self._count)
                error = channel_error or self._failed_sources.get(src)
                if error is not None:
                    entry.fail(error())
                    return entry.future
            elif channel_error is not None:  # arrived, but the channel failed (an abort) before it was asked for
                entry.fail(channel_error())
                return entry.future
            # Posted, also when (part of) its message arrived first: a sender or a channel failing
            # from now on fails it (it is no longer among the unmatched).
            self._posted[key] = entry
        entry.attach(sink)
        if entry.future.done():
            with self._lock:
                self._posted.pop(key, None)
        else:
            entry.future.add_done_callback(lambda _: self._forget(key))
        return entry.future

    def cancel(self, key: Key, error: BaseException) -> bool:
        """Withdraws a posted receive that nothing has arrived for yet.

        Its sequence number goes to the next receive on the same (src, channel,
        tag), so the message it was waiting for is not lost. Returns False when
        the message had begun to arrive (the receive stays posted).
        """
        with self._lock:
            entry = self._posted.get(key)
            if entry is None or entry.header is not None:
                return False
            del self._posted[key]
            heapq.heappush(self._released[key[:3]], key[3])
        entry.fail(error)
        return True

    def deliver(self, src: int, header: peer_pb2.MessageHeader) -> _Entry:
        """Called for each arriving message header; returns the writer for its bytes."""
        key = (src, header.channel, header.tag, header.sequence)
        with self._lock:
            entry = self._posted.get(key)
            if entry is None:
                entry = _Entry(src, header.channel, self._count)
                self._unmatched[key] = entry
        entry.set_header(header)
        return entry

    def fail_source(self, src: int, make_error: Callable[[], BaseException]) -> None:
        """Fails every incomplete message from ``src``, now and for later receives.

        Messages from ``src`` that had fully arrived can still be received.
        """
        with self._lock:
            self._failed_sources.setdefault(src, make_error)
            entries = [e for e in list(self._posted.values()) + list(self._unmatched.values()) if e.src == src]
        for entry in entries:
            if not entry.arrived:
                entry.fail(make_error())

    def fail_channel(self, channel: int, make_error: Callable[[], BaseException]) -> None:
        """Fails every pending receive on ``channel``, now and for later receives."""
        with self._lock:
            self._failed_channels.setdefault(channel, make_error)
            entries = [e for e in self._posted.values() if e.channel == channel]
        for entry in entries:
            entry.fail(make_error())

    def waiting_on(self, channel: int) -> Set[int]:
        """Ranks with a posted, incomplete receive on ``channel``."""
        with self._lock:
            return {e.src for e in self._posted.values() if e.channel == channel and not e.future.done()}

    def _forget(self, key: Key) -> None:
        with self._lock:
            self._posted.pop(key, None)
