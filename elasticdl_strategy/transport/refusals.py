"""Rate-limited logging of refused traffic: one summary line per source per interval.

Refusing a call or a connection must cost a hostile client more than the
server: a warning per refusal would let anyone fill the logs (and the disk
of the node). :class:`RefusalLog` counts refusals by source and kind and
logs at most one line per source per interval, with the counts since the
last one. It never logs what the caller sent (a wrong token included).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Dict, Optional
from urllib.parse import unquote

# Sources tracked one by one at most; beyond, refusals are counted under OTHER_SOURCES.
MAX_SOURCES = 1024
OTHER_SOURCES = "other sources"


class RefusalLog:
    """Counts refusals by source and kind; logs one warning per source per ``interval_s``.

    Example::

        refusals = RefusalLog(logging.getLogger(__name__), what="calls")
        refusals.refused("10.0.0.7", "no job token")
        # WARNING refused 1 calls from 10.0.0.7: 1 no job token
        # ... and after 10 s at most one line per source: refused 30 calls from 10.0.0.7 in the last 10s: ...
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._logger = logger
        self._what = what
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: Dict[str, Counter] = {}
        self._logged: Dict[str, float] = {}

    def refused(self, source: Optional[str], kind: str) -> None:
        """Counts one refusal of ``kind`` from ``source``; logs the counts if the interval passed."""
        source = source or "an unknown source"
        now = self._clock()
        with self._lock:
            if source not in self._counts and len(self._counts) >= MAX_SOURCES:
                source = OTHER_SOURCES
            counts = self._counts.setdefault(source, Counter())
            counts[kind] += 1
            last = self._logged.get(source)
            if last is not None and now - last < self._interval_s:
                return
            del self._counts[source]
            self._logged[source] = now
            if len(self._logged) > MAX_SOURCES:
                self._forget_quiet(now)
        total = sum(counts.values())
        detail = ", ".join(f"{n} {k}" for k, n in counts.most_common())
        window = "" if last is None else f" in the last {now - last:.0f}s"
        self._logger.warning("refused %d %s from %s%s: %s", total, self._what, source, window, detail)

    def _forget_quiet(self, now: float) -> None:
        """Drops the sources whose last line is older than an interval (they start afresh)."""
        for source in [s for s, t in self._logged.items() if now - t >= self._interval_s and s not in self._counts]:
            del self._logged[source]


# Every refused call, whatever refused it (the token check, a bound, a malformed request), so that
# a source gets one line per interval with all its kinds counted.
call_refusals = RefusalLog(logging.getLogger(__name__), what="calls")


def grpc_peer_host(peer: str) -> Optional[str]:
    """The IP address in a gRPC peer string; ``None`` for other kinds (``"unix:..."``).

    >>> grpc_peer_host("ipv4:10.0.0.3:5123"), grpc_peer_host("ipv6:%5B::1%5D:5123")
    ('10.0.0.3', '::1')
    """
    kind, _, rest = unquote(peer or "").partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rsplit(":", 1)[0]
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return normalize_host(host)


def normalize_host(host: str) -> str:
    """The IPv4 address of an IPv4 peer of an IPv6 socket; other addresses unchanged.

    >>> normalize_host("::ffff:10.0.0.3"), normalize_host("::1")
    ('10.0.0.3', '::1')
    """
    return host[len("::ffff:") :] if host.startswith("::ffff:") and "." in host else host
