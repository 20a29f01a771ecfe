"""Life marks: a process's death is seen through a robust mutex in shared memory, its release is not a death."""

import contextlib
import gc
import mmap
import os
import signal
import subprocess
import sys
import threading

import pytest

from elasticdl_strategy.transport import life_marks
from tests.launch import REPO_ROOT, worker_script

pytestmark = pytest.mark.skipif(not life_marks.AVAILABLE, reason="life marks need Linux, glibc and x86-64")

OFFSET = 512


@pytest.fixture
def shared_page(tmp_path):
    path = tmp_path / "page"
    path.write_bytes(bytes(mmap.PAGESIZE))
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), mmap.PAGESIZE)
    yield str(path), mapping


def _holder(path: str, how: str) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, worker_script("life_mark_holder.py"), path, str(OFFSET), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def _end(holder: subprocess.Popen) -> None:
    holder.kill()
    holder.wait(timeout=10)


@contextlib.contextmanager
def _watched(shared_page, how: str):
    """A holder process started with ``how`` and a watch of its mark: ``(holder, died, watch)``;
    both are ended on the way out."""
    path, mapping = shared_page
    holder, died = _holder(path, how), threading.Event()
    watch = life_marks.watch(mapping, OFFSET, died.set)
    try:
        yield holder, died, watch
    finally:
        watch.stop()
        _end(holder)


def test_the_death_of_the_holder_is_seen_at_once(shared_page):
    with _watched(shared_page, "hold") as (holder, died, _):
        assert not died.wait(0.2)  # alive: nothing reported
        os.kill(holder.pid, signal.SIGKILL)
        assert died.wait(10), "the holder's death was not reported"


def test_a_mark_released_on_purpose_is_not_a_death_even_when_the_holder_then_dies(shared_page):
    with _watched(shared_page, "release") as (holder, died, watch):
        assert holder.stdout.readline().strip() == "released"
        watch._thread.join(10)  # it got the mark: nothing more to watch
        assert not watch._thread.is_alive()
        _end(holder)
        assert not died.is_set()


def test_a_stopped_watch_reports_nothing(shared_page):
    with _watched(shared_page, "hold") as (holder, died, watch):
        watch.stop()
        os.kill(holder.pid, signal.SIGKILL)
        watch._thread.join(10)
        assert not watch._thread.is_alive() and not died.is_set()


def test_the_mapping_stays_mapped_while_a_watch_or_a_mark_uses_it(shared_page):
    _, mapping = shared_page
    mark = life_marks.hold(mapping, OFFSET)
    with pytest.raises(BufferError):
        mapping.close()  # unmapped, the holding thread's mutex would be gone from under it
    mark.release()
    watch = life_marks.watch(mapping, OFFSET, lambda: None)  # gets the released mark and stops
    watch._thread.join(10)
    with pytest.raises(BufferError):
        mapping.close()  # the watch keeps its view while it lives
    del mark, watch
    gc.collect()
    mapping.close()  # once both are gone


def test_an_arena_dropped_before_its_stream_ended_lets_go_of_its_mark(tmp_path):
    from elasticdl_strategy.transport.shared_memory import SendArena

    def holders():
        return sum(thread.name == "edl-life-mark" and thread.is_alive() for thread in threading.enumerate())

    before = holders()
    arena = SendArena(str(tmp_path), slots=2, slot_size=64 << 10, lane_bytes=1 << 20)
    assert holders() == before + 1
    arena.unlink()
    del arena  # never offered, never released: its stream failed to start
    gc.collect()
    assert holders() == before
