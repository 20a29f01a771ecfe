"""Holds a life mark in a shared file for test_life_marks.py: ``FILE OFFSET hold|release``.

Prints "held" once it holds the mark; with "release" it then lets go of it, prints "released",
and lives on until its stdin closes (so that only the release, not its death, can be seen).
"""

import mmap
import os
import sys

from elasticdl_strategy.transport import life_marks


def main(path: str, offset: int, how: str) -> None:
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    os.close(fd)
    mark = life_marks.hold(mapping, offset)
    print("held", flush=True)
    if how == "release":
        mark.release()
        print("released", flush=True)
    sys.stdin.read()  # until the test closes it (or kills this process)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
