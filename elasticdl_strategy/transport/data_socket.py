"""Direct data sockets: a stream's frames on their own TCP connection (TLS when the job
uses it), set up through gRPC.

gRPC Python copies every message several times under the GIL and hands it
between threads on the way (see ``benchmarks/README.md``); a plain socket
moves bulk bytes straight from the sender's array into the kernel and from
the kernel into the receiver's buffer. gRPC stays the control path: a
``Transfer`` stream asks for a data socket in its hello, the receiver answers
on that authenticated stream with a port and a one-time random ticket, and
the sender connects and writes the ticket first. A connection whose first
bytes are not a live ticket is closed without touching any state, so the
job token still guards everything (tickets are only handed out on streams
that presented it).

On the socket every control frame is length-prefixed (4 bytes, little
endian) and a payload follows its header as raw bytes. The gRPC stream stays
open beside it; when it ends (the peer died, the server stopped), the socket
is shut down, which wakes any thread blocked on it.
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Union

from elasticdl_strategy.errors import ConfigError, DataSocketClosed
from elasticdl_strategy.transport.refusals import RefusalLog, normalize_host

logger = logging.getLogger(__name__)
_refusals = RefusalLog(logger, what="data connections")

TICKET_BYTES = 32
_ACCEPTED = b"\x01"  # the listener's answer to a valid ticket, before the sender commits to the socket
_LENGTH = struct.Struct("<I")
# Bytes a read asks the kernel for at once: a frame and a small payload usually come in one read.
_READ_AHEAD = 64 << 10
# Connections still to present their ticket, at most, in all and from one address: more are
# closed at once (a flood of connections that send nothing must not pile up threads).
MAX_PENDING_CONNECTIONS = 64
MAX_PENDING_PER_SOURCE = 16
# How often the acceptor closes connections past their deadline for presenting a ticket.
REAP_INTERVAL_S = 0.25


def _tune(sock: socket.socket, keepalive_s: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    seconds = max(1, int(round(keepalive_s)))
    for name, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", seconds), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _poll_ms(timeout: float) -> int:
    """``timeout`` seconds as ``poll``'s milliseconds, rounded up (never a busy wait for less than 1 ms)."""
    return max(0, int(timeout * 1000 + 0.999))


class FrameSocket:
    """A connected data socket: length-prefixed frames and raw payload bytes.

    Reads come from one thread at a time and writes from one thread at a time
    (either may be the same); :meth:`shutdown` may be called from any thread.
    Reads go through a read-ahead buffer of this object's own, so that
    :meth:`buffered` and :meth:`wait_readable` can tell whether a read would wait.
    """

    def __init__(self, sock: socket.socket, max_frame: int):
        sock.settimeout(None)  # liveness comes from the gRPC stream beside it and TCP keepalive
        self._sock = sock
        self._max_frame = max_frame
        self._buffer = bytearray(_READ_AHEAD)
        self._view = memoryview(self._buffer)
        self._start = 0  # the buffered bytes not yet read are _buffer[_start:_end]
        self._end = 0
        self._fd = sock.fileno()
        self._is_tls = isinstance(sock, ssl.SSLSocket)
        self._pending = getattr(sock, "pending", None)  # TLS: records decrypted but not read
        self._pollers: Dict[Optional[int], "select.poll"] = {}  # by the wake fd polled beside the socket

    def send_frame(
        self, frame: bytes, payload: Optional[memoryview] = None, on_block: Optional[Callable[[], None]] = None
    ) -> None:
        """Writes one control frame, then ``payload`` raw (joined to the frame when small,
        else written straight from its memory). ``on_block`` is called once, before the write
        waits for room in the socket's buffers (under TLS: before it writes).

        Raises:
            DataSocketClosed: the connection is gone.
        """
        parts: List[Union[bytes, memoryview]]
        if payload is not None and len(payload) <= 64 << 10:
            parts = [b"".join((_LENGTH.pack(len(frame)), frame, payload))]
        else:
            parts = [_LENGTH.pack(len(frame)) + frame] + ([payload] if payload is not None and len(payload) else [])
        try:
            for part in parts:
                sent = 0
                if on_block is not None:
                    sent = self._send_now(part)
                    if sent < len(part):
                        on_block()
                        on_block = None
                if sent < len(part):  # sendall of nothing still makes a system call
                    self._sock.sendall(memoryview(part)[sent:])
        except OSError as e:
            raise DataSocketClosed(f"writing to the data socket failed: {e}") from None

    def _send_now(self, data) -> int:
        """Writes what fits in the socket's buffers now; returns how many bytes (0 under TLS)."""
        if self._is_tls:
            return 0  # no non-blocking flag for one write: treat it as one that may wait
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def recv_frame(self) -> bytes:
        """Reads the next control frame.

        Raises:
            DataSocketClosed: the connection ended.
            ValueError: the length prefix is larger than any valid frame.
        """
        if self._start == self._end:  # nothing read ahead: read what came (the frame, and usually more)
            self._fill()
        start = self._start
        if self._end - start >= _LENGTH.size:  # the usual case: the prefix came in the read ahead
            (length,) = _LENGTH.unpack_from(self._buffer, start)
            self._start = start + _LENGTH.size
        else:
            (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        if length > self._max_frame:
            raise ValueError(f"a {length}-byte frame on the data socket (at most {self._max_frame})")
        return self._read(length)

    def recv_into(self, view: memoryview) -> None:
        """Fills ``view`` with the next ``len(view)`` payload bytes.

        Raises:
            DataSocketClosed: the connection ended first.
        """
        filled = self._take_buffered(view)
        while filled < len(view):
            filled += self._recv(view[filled:])

    def buffered(self) -> bool:
        """Whether bytes already came in that a read has not taken (a read returns without waiting for the network)."""
        return self._end > self._start or (self._pending is not None and self._pending() > 0)

    def wait_readable(self, timeout: Optional[float], wake_fd: Optional[int] = None) -> bool:
        """Waits up to ``timeout`` seconds (``None``: no limit) for something to read (bytes, or the
        connection's end); returns whether there is, False at once when ``wake_fd`` becomes readable."""
        if self.buffered():
            return True
        poller = self._pollers.get(wake_fd)
        if poller is None:
            poller = self._pollers[wake_fd] = select.poll()
            poller.register(self._fd, select.POLLIN | select.POLLPRI)
            if wake_fd is not None:
                poller.register(wake_fd, select.POLLIN)
        for ready, _ in poller.poll(None if timeout is None else _poll_ms(timeout)):
            if ready == self._fd:
                return True
        return False

    @staticmethod
    def wait_until_woken(timeout: float, wake_fd: int) -> bool:
        """Waits up to ``timeout`` seconds for ``wake_fd`` to become readable; returns whether it did."""
        poller = select.poll()
        poller.register(wake_fd, select.POLLIN)
        return bool(poller.poll(_poll_ms(timeout)))

    def _read(self, n: int) -> bytes:
        if self._end - self._start >= n:  # the usual case: the whole frame came in one read ahead
            data = bytes(self._view[self._start : self._start + n])
            self._start += n
            return data
        out = bytearray(n)
        view = memoryview(out)
        filled = self._take_buffered(view)
        while filled < n:
            if n - filled < len(self._buffer):
                self._fill()
                filled += self._take_buffered(view[filled:])
            else:
                filled += self._recv(view[filled:])
        return bytes(out)

    def _take_buffered(self, view: memoryview) -> int:
        """Moves read-ahead bytes into ``view``; returns how many."""
        n = min(len(view), self._end - self._start)
        if n:
            view[:n] = self._view[self._start : self._start + n]
            self._start += n
        return n

    def _fill(self) -> None:
        """Reads what the socket has (at least one byte) into the empty read-ahead buffer."""
        n = self._recv(self._view)  # interrupted or broken, the buffer stays empty
        self._start, self._end = 0, n

    def _recv(self, view: memoryview) -> int:
        try:
            n = self._sock.recv_into(view, len(view))
        except OSError as e:
            raise DataSocketClosed(f"the data socket broke: {e}") from None
        if n == 0:
            raise DataSocketClosed("the data socket ended")
        return n

    def shutdown(self) -> None:
        """Ends the connection both ways; blocked reads and writes return at once. Idempotent."""
        try:
            # The plain socket's shutdown even for TLS: SSLSocket.shutdown drops its TLS state first,
            # and a read or write racing with it would then see or send raw bytes.
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        self._sock.close()


def connect(
    host: str,
    port: int,
    ticket: bytes,
    timeout: float,
    keepalive_s: float,
    max_frame: int,
    tls: Optional[ssl.SSLContext] = None,
    server_name: Optional[str] = None,
) -> FrameSocket:
    """Connects to a receiver's :class:`DataSocketListener` (over ``tls`` when given,
    verifying ``server_name`` or else ``host``), presents ``ticket`` and waits for it to be accepted.

    Raises:
        OSError: no accepted connection within ``timeout`` (ConnectionRefusedError: the
            listener refused the ticket; ssl.SSLError: the TLS handshake failed).
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock, keepalive_s)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        try:
            sock.sendall(ticket)
            accepted = sock.recv(1) == _ACCEPTED
        except (ConnectionResetError, BrokenPipeError):  # closed before reading (refused at accept)
            accepted = False
        if not accepted:
            raise ConnectionRefusedError(f"{host}:{port} refused the data connection")
    except OSError:
        sock.close()
        raise
    return FrameSocket(sock, max_frame)


def host_of(address: str) -> str:
    """The host of a ``host:port`` address.

    >>> host_of("10.0.0.3:4000"), host_of("[::1]:4000")
    ('10.0.0.3', '::1')
    """
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class _Pending:
    """A connection that has yet to present its ticket, and the time it must have by."""

    def __init__(self, sock: socket.socket, source: str, deadline: float):
        self.sock, self.source, self.deadline = sock, source, deadline


class DataSocketListener:
    """Accepts data sockets on ``host:port`` (port 0: any free port), over ``tls``
    when given, and hands each to the stream whose ticket it presents.

    A connection is taken only from an address a ticket was given to (on an
    authenticated stream; a ticket for ``source=None`` allows any address),
    only while fewer than :data:`MAX_PENDING_PER_SOURCE` connections from that
    address and :data:`MAX_PENDING_CONNECTIONS` in all wait for their ticket,
    and it must present the ticket (and finish its TLS handshake) within
    ``ticket_timeout_s`` in all; otherwise it is closed.

    Example::

        listener = DataSocketListener("127.0.0.1", 0, keepalive_s=2.0, max_frame=5 << 20)
        ticket = listener.expect("127.0.0.1")       # sent to the peer on its gRPC stream
        frames = listener.claim(ticket, timeout=10)  # the peer's connection

    Raises:
        ConfigError: the address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        keepalive_s: float,
        max_frame: int,
        ticket_timeout_s: float = 5.0,
        tls: Optional[ssl.SSLContext] = None,
    ):
        host = host or "0.0.0.0"
        self._tls = tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._keepalive_s = keepalive_s
        self._max_frame = max_frame
        self._ticket_timeout_s = ticket_timeout_s
        self._cond = threading.Condition()
        self._expected: Dict[bytes, Optional[FrameSocket]] = {}
        self._awaiting: Dict[bytes, Optional[str]] = {}  # tickets without a connection yet: their source
        self._pending: Dict[int, _Pending] = {}
        self._closed = False
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(64)
            self._sock.settimeout(REAP_INTERVAL_S)
        except OSError as e:
            self._sock.close()
            raise ConfigError(f"cannot listen for data sockets on {host}:{port}: {e.strerror}") from None
        self.port: int = self._sock.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="edl-data-accept", daemon=True)
        self._acceptor.start()

    def expect(self, source: Optional[str] = None) -> bytes:
        """Registers and returns a fresh ticket for one connection from the IP address
        ``source`` (``None``: from any address)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._cond:
            self._expected[ticket] = None
            self._awaiting[ticket] = normalize_host(source) if source else None
        return ticket

    def claim(self, ticket: bytes, timeout: float) -> FrameSocket:
        """Waits for the connection that presents ``ticket`` and takes it.

        Raises:
            TimeoutError: it did not arrive within ``timeout``.
        """
        with self._cond:
            arrived = self._cond.wait_for(lambda: self._expected.get(ticket) is not None or self._closed, timeout)
            frames = self._expected.pop(ticket, None)
            self._awaiting.pop(ticket, None)
        if not arrived or frames is None:
            if frames is not None:
                frames.close()
            if self._closed:
                raise TimeoutError("the data socket listener is closed")
            raise TimeoutError(f"no data socket presented its ticket within {timeout:g}s")
        return frames

    def discard(self, ticket: bytes) -> None:
        """Forgets an unused ticket (closing its connection if one arrived)."""
        with self._cond:
            frames = self._expected.pop(ticket, None)
            self._awaiting.pop(ticket, None)
        if frames is not None:
            frames.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            leftovers = [f for f in self._expected.values() if f is not None]
            self._expected.clear()
            self._awaiting.clear()
            self._cond.notify_all()
        for frames in leftovers:
            frames.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._acceptor.join(timeout=2.0)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                self._reap(time.monotonic())
                continue
            except OSError:
                return  # closed
            source = normalize_host(peer[0])
            with self._cond:
                refusal = self._refusal(source)
                if refusal is None:
                    pending = _Pending(conn, source, time.monotonic() + self._ticket_timeout_s)
                    self._pending[id(pending)] = pending
            if refusal is not None:
                _refusals.refused(source, refusal)
                conn.close()
                continue
            threading.Thread(target=self._admit, args=(pending,), name="edl-data-admit", daemon=True).start()

    def _refusal(self, source: str) -> Optional[str]:
        """Why a new connection from ``source`` is refused before it is read, or ``None``."""
        sources = set(self._awaiting.values())
        if source not in sources and None not in sources:
            return "from an address no ticket was given to"
        if len(self._pending) >= MAX_PENDING_CONNECTIONS:
            return "beyond the connections waiting for a ticket"
        if sum(p.source == source for p in self._pending.values()) >= MAX_PENDING_PER_SOURCE:
            return "beyond the connections waiting for a ticket from one address"
        return None

    def _reap(self, now: float) -> None:
        """Shuts down the connections that missed their deadline (their admission then ends)."""
        with self._cond:
            late = [p for p in self._pending.values() if p.deadline <= now]
        for pending in late:
            try:
                socket.socket.shutdown(pending.sock, socket.SHUT_RDWR)  # the plain socket, even under TLS
            except OSError:
                pass

    def _admit(self, pending: _Pending) -> None:
        """Reads the ticket (bounded in time) and hands the connection over, or closes it."""
        try:
            self._hand_over(pending)
        finally:
            with self._cond:
                self._pending.pop(id(pending), None)

    def _hand_over(self, pending: _Pending) -> None:
        conn = pending.sock
        try:
            conn.settimeout(self._ticket_timeout_s)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                pending.sock = conn  # what the reaper shuts down from now on
                if pending.deadline <= time.monotonic():
                    raise TimeoutError("no ticket in time")
                conn.do_handshake()
            ticket = b""
            while len(ticket) < TICKET_BYTES:
                part = conn.recv(TICKET_BYTES - len(ticket))
                if not part:
                    break
                ticket += part
            _tune(conn, self._keepalive_s)
        except OSError:
            ticket = b""
        with self._cond:
            accepted = (
                len(ticket) == TICKET_BYTES
                and self._expected.get(ticket, False) is None
                and self._awaiting.get(ticket, "") in (None, pending.source)
                and pending.deadline > time.monotonic()
                and self._pending.pop(id(pending), None) is not None  # the reaper cannot touch it now
            )
            if accepted:
                try:
                    conn.sendall(_ACCEPTED)  # one byte into an empty send buffer: does not block
                    self._expected[ticket] = FrameSocket(conn, self._max_frame)
                    del self._awaiting[ticket]
                    self._cond.notify_all()
                except OSError:
                    accepted = False
        if not accepted:
            _refusals.refused(pending.source, "without a valid ticket in time")
            conn.close()
