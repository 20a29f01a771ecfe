"""Host segments: one shared file per membership, its slots, arrivals, notes and doorbells."""

import os
import struct
import threading
import time

import pytest

from elasticdl_strategy.transport import futex
from elasticdl_strategy.transport.host_segment import NAME_PREFIX, HostSegment
from elasticdl_strategy.transport.shared_memory import STALE_AFTER_S

pytestmark = pytest.mark.skipif(not futex.AVAILABLE, reason="host segments need Linux futexes on x86-64")

SLOT = 4096


@pytest.fixture
def pair(tmp_path):
    """Rank 0's and rank 1's mappings of one segment of 3 ranks."""
    first = HostSegment.create(str(tmp_path), 0, 3, SLOT)
    second = HostSegment.open(str(tmp_path), first.name, first.nonce, 1, 3)
    yield first, second
    first.unlink()
    first.close()
    second.close()


def test_a_published_slot_and_note_are_seen_by_every_mapping(pair):
    first, second = pair
    assert first.missing(1) == [0, 1, 2] and not first.all_arrived(1)
    second.slot(1, 1, 5)[:] = b"hello"
    second.publish(1, b"allreduce #0")
    assert first.missing(1) == [0, 2] and first.arrivals(1) == 1 and not first.all_arrived(1)
    assert bytes(first.slot(1, 1, 5)) == b"hello"
    assert first.note(1, 1) == b"allreduce #0"
    assert first.not_noted(1, b"allreduce #0") == [0, 2]  # ranks 0 and 2 published nothing yet
    assert first.not_noted(1, b"allreduce #1") == [0, 1, 2]
    assert first.not_noted(1, b"allreduce #00") == [0, 1, 2]  # a longer note is another note
    assert first.not_noted(1, b"allreduce #") == [0, 1, 2]  # and a shorter one
    first.publish(1, b"allreduce #0")
    assert second.not_noted(1, b"allreduce #0") == [2] and second.missing(1) == [2]
    assert not second.all_arrived(1) and second.all_arrived(0)


def test_the_two_parities_keep_a_slow_readers_slot(pair):
    first, second = pair
    second.slot(1, 1, 1)[:] = b"a"
    second.publish(1, b"one")
    second.slot(1, 0, 1)[:] = b"b"  # the next call's slot: the last one is untouched
    second.publish(2, b"two")
    assert bytes(first.slot(1, 1, 1)) == b"a" and first.note(1, 1) == b"one"
    assert bytes(first.slot(1, 0, 1)) == b"b" and first.note(1, 2) == b"two"


def test_a_slot_is_never_handed_out_larger_than_it_is(pair):
    first, _ = pair
    assert len(first.slot(0, 0, SLOT)) == SLOT
    with pytest.raises(ValueError, match="do not fit a slot"):
        first.slot(0, 0, SLOT + 1)  # it would reach into rank 0's other parity


def test_opening_checks_the_nonce_the_membership_and_the_name(pair, tmp_path):
    first, _ = pair
    with pytest.raises(ValueError, match="not the offered segment"):
        HostSegment.open(str(tmp_path), first.name, b"x" * 16, 2, 3)
    with pytest.raises(ValueError, match="membership of 4 ranks"):
        HostSegment.open(str(tmp_path), first.name, first.nonce, 2, 4)
    with pytest.raises(ValueError, match="invalid segment name"):
        HostSegment.open(str(tmp_path), "../etc/passwd", first.nonce, 2, 3)
    with pytest.raises(OSError):  # another host: no such file
        HostSegment.open(str(tmp_path), f"{NAME_PREFIX}1-0123456789abcdef", first.nonce, 2, 3)


def test_a_sleeper_is_woken_by_the_publish_it_waits_for(pair):
    first, second = pair
    woke = []

    def sleep():
        seen = first.doorbell
        first.sleep(seen, 1, timeout=30.0)
        woke.append(time.monotonic())

    sleeper = threading.Thread(target=sleep)
    sleeper.start()
    deadline = time.monotonic() + 10
    while not first._sleeping[0][0]:  # waiting for the sleeper to be asleep (or about to)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    published = time.monotonic()
    second.publish(1, b"")
    sleeper.join(10)
    assert woke and woke[0] - published < 5.0  # woken, not its 30 s timeout


def test_a_sleep_returns_at_once_when_all_have_arrived_and_on_wake(pair):
    first, second = pair
    for segment in (first, second):
        segment.publish(1, b"")
    first._arrivals[2][0] = 1  # the third rank's arrival, written here for it
    start = time.monotonic()
    first.sleep(first.doorbell, 1, timeout=30.0)  # nobody missing: no sleep at all
    assert time.monotonic() - start < 5.0

    woken = threading.Timer(0.2, first.wake)
    woken.start()
    start = time.monotonic()
    first.sleep(first.doorbell, 2, timeout=30.0)  # all missing; another thread's wake ends it
    assert time.monotonic() - start < 10.0
    woken.join()


def test_a_current_note_being_rewritten_reads_as_none(pair):
    first, second = pair
    second.announce(b"broadcast #7")
    assert first.current(1) == b"broadcast #7"
    assert first.current(2) == b""  # never announced
    start = second._current[1]
    version = struct.unpack_from("<I", second._map, start)[0]
    struct.pack_into("<I", second._map, start, version + 1)  # a writer in the middle of it
    assert first.current(1) == b""
    second.announce(b"allreduce #8")  # the next write ends even again
    assert first.current(1) == b"allreduce #8"


def test_creating_a_segment_removes_segments_abandoned_long_ago(tmp_path):
    stale, fresh = f"{NAME_PREFIX}123-0123456789abcdef", f"{NAME_PREFIX}456-fedcba9876543210"
    for name in (stale, fresh):
        (tmp_path / name).write_bytes(b"x")
    long_ago = time.time() - STALE_AFTER_S - 60
    os.utime(tmp_path / stale, (long_ago, long_ago))
    segment = HostSegment.create(str(tmp_path), 0, 2, SLOT)
    left = sorted(os.listdir(tmp_path))
    assert stale not in left and fresh in left and segment.name in left
    segment.unlink()
    assert segment.name not in os.listdir(tmp_path)
    segment.close()
