"""Two hosts as network namespaces joined by a veth pair (needs root and ``ip``), for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from typing import Callable, Iterator, NamedTuple, Optional


class TwoHosts(NamedTuple):
    namespace_a: str
    address_a: str
    namespace_b: str
    address_b: str
    cut: Callable[[], None]  # takes b's end of the link down: a's packets to b vanish without an error


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Unavailable(Exception):
    """No network namespaces here (not root, no ``ip``, or the kernel refused)."""


@contextlib.contextmanager
def two_hosts(rate: Optional[str] = None) -> Iterator[TwoHosts]:
    """Creates the namespaces and the link (each way limited to ``rate``, a ``tc`` rate such as
    ``"1gbit"``, when given), yields them, and deletes them.

    Raises:
        Unavailable: with why.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise Unavailable("needs root and the ip command for network namespaces")
    tag = secrets.token_hex(3)
    a, b, subnet = f"edl{tag}a", f"edl{tag}b", f"10.251.{int(tag[:2], 16)}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        for ns, side, host in ((a, "a", 1), (b, "b", 2)):
            _ip("link", "set", f"v{tag}{side}", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", f"v{tag}{side}")
            _ip("-n", ns, "link", "set", f"v{tag}{side}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate is not None:
                tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"v{tag}{side}", "root"]
                limit = ["tbf", "rate", rate, "burst", "1mbit", "latency", "100ms"]
                subprocess.run([*tc, *limit], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        why = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        raise Unavailable(f"network namespaces unavailable: {why}") from None
    try:
        yield TwoHosts(a, f"{subnet}.1", b, f"{subnet}.2", lambda: _ip("-n", b, "link", "set", f"v{tag}b", "down"))
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts_or_skip() -> Iterator[TwoHosts]:
    """:func:`two_hosts` for a test, which is skipped where there are none."""
    import pytest

    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(two_hosts())
        except Unavailable as e:
            pytest.skip(str(e))
        yield hosts
