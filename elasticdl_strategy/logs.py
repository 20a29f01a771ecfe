"""Logging set-up: one format for every process of a job, with who logged each line.

Importing the package configures nothing (its logger has a ``NullHandler``).
The launcher and coordinator call :func:`configure` with their role, and a
worker does so when it joins (``runtime.init``, which ``AllReduceStrategy``
calls), naming its worker id and current rank. ``EDL_LOG_LEVEL`` (``DEBUG``,
``INFO``, ``WARNING``, ``ERROR``; default ``INFO``) sets the level of the
package's loggers. A program that set up logging before (a handler on the
root logger) keeps it: the package's records go to its handlers.

Every line reads ``TIME LEVEL [WHO] LOGGER: MESSAGE``, e.g.::

    2026-12-02 01:40:51,202 INFO [worker-1 rank 0/2] elasticdl_strategy.runtime.worker: ...
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Optional

from elasticdl_strategy.errors import ConfigError

PACKAGE = "elasticdl_strategy"
LEVEL_VARIABLE = "EDL_LOG_LEVEL"
FORMAT = "%(asctime)s %(levelname)s [%(edl_who)s] %(name)s: %(message)s"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class ProcessContext(logging.Filter):
    """Adds ``edl_who`` (what ``who()`` returns when the record is made) to every record."""

    def __init__(self, who: Callable[[], str]):
        super().__init__()
        self._who = who

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.edl_who = self._who()
        except Exception:  # noqa: BLE001 - a log line must never fail for its prefix
            record.edl_who = "?"
        return True


def level_from_env(env: Mapping[str, str]) -> Optional[int]:
    """The level ``EDL_LOG_LEVEL`` names; ``None`` when it is not set.

    >>> level_from_env({"EDL_LOG_LEVEL": "debug"}) == logging.DEBUG, level_from_env({})
    (True, None)

    Raises:
        ConfigError: it names no level.
    """
    name = env.get(LEVEL_VARIABLE, "").strip().upper()
    if not name:
        return None
    if name not in _LEVELS:
        raise ConfigError(f"{LEVEL_VARIABLE}={env[LEVEL_VARIABLE]!r} must be one of {', '.join(_LEVELS)}")
    return getattr(logging, name)


def configure(who: Callable[[], str], env: Mapping[str, str]) -> None:
    """Sets up the package's logging in a process of a job, unless the program already set up its own.

    When the root logger has no handler, the package logger gets one
    (standard error, :data:`FORMAT`, ``who()`` in every line) and logs at
    ``EDL_LOG_LEVEL`` (``INFO`` by default); its records then stop there, so
    that a program that configures the root logger later does not print them
    twice. When the root logger has handlers, the records go to them, at
    ``EDL_LOG_LEVEL`` if set. Calling it again changes nothing.

    Example::

        configure(lambda: "coordinator", os.environ)

    Raises:
        ConfigError: ``EDL_LOG_LEVEL`` names no level.
    """
    level = level_from_env(env)
    package = logging.getLogger(PACKAGE)
    if any(isinstance(h, _JobHandler) for h in package.handlers):
        return
    if not logging.getLogger().handlers:
        handler = _JobHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(ProcessContext(who))
        package.addHandler(handler)
        package.propagate = False
        level = logging.INFO if level is None else level
    if level is not None:
        package.setLevel(level)


class _JobHandler(logging.StreamHandler):
    """The handler :func:`configure` installs (standard error)."""
