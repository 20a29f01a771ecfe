"""Command-line parsing shared by ``elasticdl-strategy run`` and ``elasticdl-strategy k8s``."""

from __future__ import annotations

import argparse
from typing import List, NoReturn, Tuple


class OneLineParser(argparse.ArgumentParser):
    """Reports bad arguments in one line and exits 2, before anything starts."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def split_command(argv: List[str]) -> Tuple[List[str], List[str]]:
    """``[options..., "--", command...]`` to ``(options, command)``.

    >>> split_command(["--workers", "2", "--", "python3", "train.py", "--", "x"])
    (['--workers', '2'], ['python3', 'train.py', '--', 'x'])
    >>> split_command(["--help"])
    (['--help'], [])
    """
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]
