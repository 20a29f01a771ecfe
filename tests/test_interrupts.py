"""A SIGTERM to pytest runs the tests' ``finally`` blocks (tests/interrupts.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.launch import REPO_ROOT

CHILD_TEST = textwrap.dedent(
    """
    import subprocess, sys

    def test_holds_a_child():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        try:
            open({pid_file!r}, "w").write(str(child.pid))
            child.wait(timeout=300)
        finally:
            child.kill()
            child.wait()
    """
)


def _wait_for(path, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not (os.path.exists(path) and open(path).read()):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{path} not written after {timeout} s"
        time.sleep(0.05)
    return int(open(path).read())


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent, pytest, may be gone).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_to_pytest_kills_what_its_tests_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    (tmp_path / "test_child.py").write_text(CHILD_TEST.format(pid_file=str(pid_file)))
    pytest_proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.interrupts", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    child = None
    try:
        child = _wait_for(str(pid_file), pytest_proc)
        pytest_proc.send_signal(signal.SIGTERM)
        out, _ = pytest_proc.communicate(timeout=60)
        assert "KeyboardInterrupt" in out, out
        assert not _alive(child), f"the test's child {child} outlived pytest:\n{out}"
    finally:
        if pytest_proc.poll() is None:
            pytest_proc.kill()
            pytest_proc.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
