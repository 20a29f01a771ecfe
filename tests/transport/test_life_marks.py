"""Life marks: a process's death is seen through a robust mutex in shared memory, its release is not a death."""

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


def test_the_death_of_the_holder_is_seen_at_once(shared_page):
    path, mapping = shared_page
    holder, died = _holder(path, "hold"), threading.Event()
    watch = life_marks.watch(mapping, OFFSET, died.set)
    try:
        assert not died.wait(0.2)  # alive: nothing reported
        os.kill(holder.pid, signal.SIGKILL)
        assert died.wait(10), "the holder's death was not reported"
    finally:
        watch.stop()
        _end(holder)


def test_a_mark_released_on_purpose_is_not_a_death_even_when_the_holder_then_dies(shared_page):
    path, mapping = shared_page
    holder, died = _holder(path, "release"), threading.Event()
    watch = life_marks.watch(mapping, OFFSET, died.set)
    try:
        assert holder.stdout.readline().strip() == "released"
        watch._thread.join(10)  # it got the mark: nothing more to watch
        assert not watch._thread.is_alive()
        _end(holder)
        assert not died.is_set()
    finally:
        watch.stop()
        _end(holder)


def test_a_stopped_watch_reports_nothing(shared_page):
    path, mapping = shared_page
    holder, died = _holder(path, "hold"), threading.Event()
    watch = life_marks.watch(mapping, OFFSET, died.set)
    watch.stop()
    try:
        os.kill(holder.pid, signal.SIGKILL)
        watch._thread.join(10)
        assert not watch._thread.is_alive() and not died.is_set()
    finally:
        _end(holder)


def test_the_mapping_stays_mapped_while_a_watch_or_a_mark_uses_it(shared_page):
    _, mapping = shared_page
    mark = life_marks.hold(mapping, OFFSET)
    with pytest.raises(BufferError):
        mapping.close()  # unmapped, the holding thread's mutex would be gone from under it
    mark.release()


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
