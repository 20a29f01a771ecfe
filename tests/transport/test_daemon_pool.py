"""DaemonThreadPool: an executor for the gRPC server whose blocked handlers never hold the exit."""

import subprocess
import sys
import threading

import pytest

from elasticdl_strategy.transport.daemon_pool import DaemonThreadPool


def test_results_and_exceptions_reach_the_futures():
    pool = DaemonThreadPool(max_workers=2)
    assert pool.submit(pow, 2, 10).result(timeout=10) == 1024
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=10)
    pool.shutdown()


def test_threads_are_daemons_reused_when_idle_and_bounded():
    pool = DaemonThreadPool(max_workers=3, thread_name_prefix="t")
    for i in range(5):  # one after the other: the idle thread takes each
        assert pool.submit(lambda x=i: x).result(timeout=10) == i
    assert len(pool._threads) == 1
    release = threading.Event()
    blocked = [pool.submit(release.wait, 30) for _ in range(5)]
    later = pool.submit(lambda: "ran")
    assert len(pool._threads) == 3 and all(t.daemon for t in pool._threads)
    assert not later.done()  # all three threads are busy
    release.set()
    assert later.result(timeout=10) == "ran" and all(f.result(timeout=10) for f in blocked)
    pool.shutdown()
    assert not any(t.is_alive() for t in pool._threads)


def test_a_shut_down_pool_refuses_work_and_can_cancel_what_was_queued():
    pool = DaemonThreadPool(max_workers=1)
    release = threading.Event()
    running = pool.submit(release.wait, 30)
    queued = pool.submit(lambda: "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    release.set()
    assert running.result(timeout=10) is True


@pytest.mark.parametrize("pool, exits", [("DaemonThreadPool(4)", True), ("ThreadPoolExecutor(4)", False)])
def test_a_blocked_thread_does_not_hold_the_exit(pool, exits):
    # What the pool is for: a handler blocked on a peer's stream; ThreadPoolExecutor shows the hang.
    script = (
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "from elasticdl_strategy.transport.daemon_pool import DaemonThreadPool\n"
        f"pool = {pool}\nstarted = threading.Event()\n"
        "pool.submit(lambda: (started.set(), threading.Event().wait()))\nstarted.wait()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script])
    try:
        process.wait(timeout=20 if exits else 3)
        assert exits and process.returncode == 0
    except subprocess.TimeoutExpired:
        assert not exits, "the process did not exit"
    finally:
        process.kill()
        process.wait()
