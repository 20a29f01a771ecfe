"""Waiting in tests for a condition that another thread or process makes true."""

import time


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    """Returns once ``condition()`` is true; fails the test, naming ``what``, after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.01)  # polling the condition
