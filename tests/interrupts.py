"""A SIGTERM to a test process ends it the way Ctrl-C does: every ``finally`` runs.

Without this, ``kill <pytest>`` (a CI runner's stop, a campaign script's) ends the process at
once, and the processes its tests started in their own sessions (launchers, emulated pods)
live on holding ports that every later run then fails to bind. Installed by ``tests/conftest.py``
in the controlling process and in every xdist worker (``-p tests.interrupts`` loads it as a plugin).
"""

import signal
import threading


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install() -> None:
    """Turns SIGTERM into KeyboardInterrupt in this process (from its main thread only)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_configure(config):
    install()
