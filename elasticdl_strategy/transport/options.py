"""Settings of the gRPC transport, validated in one place."""

from __future__ import annotations

import dataclasses
import mmap
import os
import ssl
from typing import Any, Dict, List, Mapping, Optional, Tuple

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport import lanes
from elasticdl_strategy.transport.frames import CHUNK_PREFIX_SIZE, MAX_CHUNK_SIZE
from elasticdl_strategy.transport.shared_memory import MAX_SLOT_SIZE, MAX_SLOTS

MiB = 1 << 20

# Headroom above the chunk size in the gRPC message limits, for frame prefixes
# and control messages.
_MESSAGE_LIMIT_HEADROOM = 1 * MiB


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Paths of PEM files for TLS on every channel and server.

    With ``ca_file`` set, servers require client certificates signed by it
    (mutual TLS) and clients verify servers against it.
    """

    cert_file: str
    key_file: str
    ca_file: Optional[str] = None
    # Name to verify in the server certificate instead of the dialled host.
    server_name: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"TLS {name} {path!r} does not exist")

    @staticmethod
    def _read(path: Optional[str]) -> Optional[bytes]:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    def server_credentials(self):
        import grpc

        ca = self._read(self.ca_file)
        return grpc.ssl_server_credentials(
            [(self._read(self.key_file), self._read(self.cert_file))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca_file),
            private_key=self._read(self.key_file),
            certificate_chain=self._read(self.cert_file),
        )

    def server_ssl_context(self) -> ssl.SSLContext:
        """The same TLS for direct data sockets, accepting side."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.num_tickets = 0  # no session resumption: the sender never reads from its data socket
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.ca_file:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.ca_file)
        return context

    def client_ssl_context(self) -> ssl.SSLContext:
        """The same TLS for direct data sockets, connecting side (verifies the server's name)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.ca_file:
            context.load_verify_locations(self.ca_file)
        else:
            context.load_default_certs()
        return context

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["TLSConfig"]:
        """Reads ``EDL_TLS_CERT``, ``EDL_TLS_KEY``, ``EDL_TLS_CA``, ``EDL_TLS_SERVER_NAME``."""
        cert, key = env.get("EDL_TLS_CERT"), env.get("EDL_TLS_KEY")
        if not cert and not key:
            return None
        if not cert or not key:
            raise ConfigError("TLS needs both EDL_TLS_CERT and EDL_TLS_KEY (or neither)")
        return cls(cert, key, env.get("EDL_TLS_CA") or None, env.get("EDL_TLS_SERVER_NAME") or None)

    def to_env(self) -> dict:
        env = {"EDL_TLS_CERT": self.cert_file, "EDL_TLS_KEY": self.key_file}
        if self.ca_file:
            env["EDL_TLS_CA"] = self.ca_file
        if self.server_name:
            env["EDL_TLS_SERVER_NAME"] = self.server_name
        return env


# How long a caller spins (yielding its core between looks) on a host whose workers outnumber its cores.
# Measured (benchmarks/allreduce.py, shared memory, 2 cores), sleeping at once -> spinning 2 ms:
# N = 3, 4 KiB 0.35 -> 0.07 ms, 256 KiB 0.35 -> 0.11, 4 MiB 2.5 -> 1.5; N = 4, 4 KiB 0.59 -> 0.23,
# 4 MiB 4.9 -> 1.9 (10 ms: no better).
OVERSUBSCRIBED_SPIN_US = 2000.0


def _workers_on_host(env: Mapping[str, str]) -> int:
    """``EDL_LOCAL_SIZE`` (the launcher's worker slots on this host), 1 when unset or not a number."""
    try:
        return max(1, int(env.get("EDL_LOCAL_SIZE") or 1))
    except ValueError:
        return 1


def workers_outnumber_cores(env: Mapping[str, str]) -> bool:
    """Whether this host's worker slots (``EDL_LOCAL_SIZE``) outnumber the cores this process may use."""
    return _workers_on_host(env) > len(os.sched_getaffinity(0))


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """How workers talk to each other.

    Args:
        chunk_size: bytes of payload per streamed frame (64 KiB to 64 MiB, a multiple of 64).
        inline_threshold: payloads up to this size travel inside the message header.
        timeout_s: default deadline of every receive and collective.
        connect_timeout_s: how long to wait for a peer's server to accept a stream.
        keepalive_s: interval of HTTP/2 keepalive pings; an unanswered ping
            for as long again marks the connection (and the peer) as failed.
        slow_warning_s: a collective still waiting after this long logs which
            ranks it waits for (once; it fails at ``timeout_s``).
        tls: TLS files, or ``None`` for plaintext (the job token still applies).
        shared_memory: offer peers a shared-memory arena for payloads; used
            with every peer that can map it (same host, or the same memory
            volume mounted at ``shared_memory_dir``), gRPC otherwise.
        shared_memory_dir: where arenas are created and looked up.
        shm_slot_size: bytes per arena slot (the unit copied in and reduced
            out while the next one is being filled).
        shm_slots: slots per arena (one arena per peer a worker sends to).
        shm_lane_bytes: bytes of each arena's lane, the ring of messages
            that callers write and read themselves (:mod:`.lanes`); 0: none.
            A message up to a quarter of it goes there as one record, one up
            to three quarters of it in pieces, when it fits at the time.
        host_segment_bytes: all-reduces up to this size among workers that all
            share one host go through a host segment, one shared-memory file
            they all map (:mod:`elasticdl_strategy.collective.host_allreduce`):
            one round (two for larger ones) instead of a message to and from
            every peer. A multiple of the page size up to 64 MiB; 0: never;
            None (``EDL_HOST_SEGMENT_BYTES`` unset): 256 KiB among 2 or 3
            workers, 4 MiB among 4 or more (less beyond 16: the segment stays
            within 128 MiB), 256 KiB where the shared-memory directory has no
            room for that (the rule: ``host_allreduce.slot_sizes``). The
            segment takes 2 · N · this many bytes.
        single_copy: all-reduces larger than the host segment's slots go
            through it too, each rank reading the others' arrays straight out
            of their processes (:mod:`.cross_memory`: one copy instead of two),
            where every worker allows it and the kernel lets every worker read
            every other (the same user, no policy against tracing); False: by
            the ring of messages.
        spin_us: how long a caller waiting for a message on a lane or data
            socket looks for it again and again before it sleeps until woken (a sleep and
            its wake-up cost tens of microseconds); 0: sleep at once. From the
            environment (``EDL_SPIN_US`` unset): 200, or where the workers of
            this host (``EDL_LOCAL_SIZE``) outnumber its cores
            :data:`OVERSUBSCRIBED_SPIN_US` with ``spin_yield`` and 0 without
            (a spin that does not yield takes the core the peer needs).
        spin_yield: between two looks, a spinning caller offers its core to
            any other thread ready to run (``sched_yield``): where the host's
            workers outnumber its cores, the peer it waits for then runs
            instead of waiting for the spin to end (MPI does the same when
            oversubscribed). Off where each worker has a core: the yields slow
            the loop down (N = 2, 256 KiB: 0.047 -> 0.080 ms). From the
            environment (``EDL_SPIN_YIELD`` unset): on when the workers of this
            host outnumber its cores.
        data_socket: move each stream's frames to a direct TCP connection
            that the stream sets up and authenticates: between hosts it
            carries the payloads too; with shared memory, the small frames
            naming slots. gRPC stays the control path. With ``tls``, the
            data socket uses the same certificates.
        hierarchical: when some host runs several workers of a job that spans
            several hosts, large all-reduces reduce within each host, cross
            between hosts once per host and come back
            (:mod:`elasticdl_strategy.collective.hierarchical`); False: the flat ring.
    """

    chunk_size: int = 4 * MiB
    inline_threshold: int = 64 << 10
    timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    keepalive_s: float = 2.0
    slow_warning_s: float = 10.0
    tls: Optional[TLSConfig] = None
    shared_memory: bool = True
    shared_memory_dir: str = "/dev/shm"
    shm_slot_size: int = 4 * MiB
    shm_slots: int = 8
    shm_lane_bytes: int = 16 * MiB
    host_segment_bytes: Optional[int] = None
    single_copy: bool = True
    spin_us: float = 200.0
    spin_yield: bool = False
    data_socket: bool = True
    hierarchical: bool = True

    def __post_init__(self) -> None:
        if not (64 << 10) <= self.chunk_size <= 64 * MiB or self.chunk_size % 64:
            raise ConfigError(
                f"chunk_size={self.chunk_size} must be a multiple of 64 between 65536 and {64 * MiB} bytes"
            )
        if self.chunk_size + CHUNK_PREFIX_SIZE > MAX_CHUNK_SIZE:
            raise ConfigError(f"chunk_size={self.chunk_size} is too large")
        if not 0 <= self.inline_threshold <= self.chunk_size:
            raise ConfigError(
                f"inline_threshold={self.inline_threshold} must be between 0 and chunk_size={self.chunk_size}"
            )
        if not (64 << 10) <= self.shm_slot_size <= MAX_SLOT_SIZE or self.shm_slot_size % 64:
            raise ConfigError(
                f"shm_slot_size={self.shm_slot_size} must be a multiple of 64 between 65536 and {MAX_SLOT_SIZE} bytes"
            )
        if not 2 <= self.shm_slots <= MAX_SLOTS:
            raise ConfigError(f"shm_slots={self.shm_slots} must be between 2 and {MAX_SLOTS}")
        if self.shm_lane_bytes and not (
            lanes.MIN_BYTES <= self.shm_lane_bytes <= lanes.MAX_BYTES and self.shm_lane_bytes % 64 == 0
        ):
            raise ConfigError(
                f"shm_lane_bytes={self.shm_lane_bytes} must be 0 or a multiple of 64 between "
                f"{lanes.MIN_BYTES} and {lanes.MAX_BYTES}"
            )
        if self.host_segment_bytes is not None and not (
            0 <= self.host_segment_bytes <= 64 * MiB and self.host_segment_bytes % mmap.PAGESIZE == 0
        ):
            raise ConfigError(
                f"host_segment_bytes={self.host_segment_bytes} must be 0 or a multiple of {mmap.PAGESIZE} "
                f"up to {64 * MiB} bytes"
            )
        if not 0 <= self.spin_us <= 10_000:
            raise ConfigError(f"spin_us={self.spin_us!r} must be between 0 and 10000 microseconds")
        for name in ("timeout_s", "connect_timeout_s", "keepalive_s", "slow_warning_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name}={value!r} must be a positive number of seconds")

    @property
    def message_limit(self) -> int:
        return self.chunk_size + _MESSAGE_LIMIT_HEADROOM

    def grpc_options(self) -> List[Tuple[str, int]]:
        """Channel and server arguments: explicit message limits, keepalive, buffer sizes."""
        keepalive_ms = int(self.keepalive_s * 1000)
        return [
            ("grpc.max_send_message_length", self.message_limit),
            ("grpc.max_receive_message_length", self.message_limit),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", keepalive_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_ms // 2),
            ("grpc.http2.max_ping_strikes", 0),
            # Measured on loopback: these take a 64 MiB client stream from ~60 ms to ~40 ms.
            ("grpc.http2.lookahead_bytes", 4 * self.chunk_size),
            ("grpc.http2.write_buffer_size", 2 * self.chunk_size),
            ("grpc.experimental.tcp_read_chunk_size", self.chunk_size),
            ("grpc.experimental.tcp_max_read_chunk_size", 2 * self.chunk_size),
            ("grpc.experimental.tcp_min_read_chunk_size", min(self.chunk_size, MiB)),
            ("grpc.enable_http_proxy", 0),
            ("grpc.enable_retries", 0),
        ]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "TransportOptions":
        """Reads ``EDL_CHUNK_SIZE``, ``EDL_TIMEOUT``, ``EDL_CONNECT_TIMEOUT``, ``EDL_KEEPALIVE``,
        ``EDL_SLOW_WARNING``, ``EDL_SHARED_MEMORY`` (0 or 1), ``EDL_SHM_DIR``, ``EDL_SHM_SLOT_SIZE``,
        ``EDL_SHM_SLOTS``, ``EDL_SHM_LANE_BYTES``, ``EDL_HOST_SEGMENT_BYTES``, ``EDL_SPIN_US``, ``EDL_SPIN_YIELD``,
        ``EDL_SINGLE_COPY``, ``EDL_DATA_SOCKET``, ``EDL_HIERARCHICAL`` (these four 0 or 1) and TLS."""
        kwargs: Dict[str, Any] = {"tls": TLSConfig.from_env(env)}
        for var, name in (
            ("EDL_SHARED_MEMORY", "shared_memory"),
            ("EDL_DATA_SOCKET", "data_socket"),
            ("EDL_HIERARCHICAL", "hierarchical"),
            ("EDL_SPIN_YIELD", "spin_yield"),
            ("EDL_SINGLE_COPY", "single_copy"),
        ):
            flag = env.get(var)
            if flag:
                if flag not in ("0", "1"):
                    raise ConfigError(f"{var}={flag!r} must be 0 or 1")
                kwargs[name] = flag == "1"
        if env.get("EDL_SHM_DIR"):
            kwargs["shared_memory_dir"] = env["EDL_SHM_DIR"]
        for var, name, kind in (
            ("EDL_CHUNK_SIZE", "chunk_size", int),
            ("EDL_TIMEOUT", "timeout_s", float),
            ("EDL_CONNECT_TIMEOUT", "connect_timeout_s", float),
            ("EDL_KEEPALIVE", "keepalive_s", float),
            ("EDL_SLOW_WARNING", "slow_warning_s", float),
            ("EDL_SHM_SLOT_SIZE", "shm_slot_size", int),
            ("EDL_SHM_SLOTS", "shm_slots", int),
            ("EDL_SHM_LANE_BYTES", "shm_lane_bytes", int),
            ("EDL_HOST_SEGMENT_BYTES", "host_segment_bytes", int),
            ("EDL_SPIN_US", "spin_us", float),
        ):
            if env.get(var):
                try:
                    kwargs[name] = kind(env[var])
                except ValueError:
                    raise ConfigError(f"{var}={env[var]!r} is not a valid {kind.__name__}") from None
        if workers_outnumber_cores(env):
            kwargs.setdefault("spin_yield", True)  # a spin that does not yield takes the core the peer needs
            kwargs.setdefault("spin_us", OVERSUBSCRIBED_SPIN_US if kwargs["spin_yield"] else 0.0)
        return cls(**kwargs)
