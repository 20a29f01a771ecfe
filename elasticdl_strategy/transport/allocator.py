"""Keep large transient buffers warm, and their first touch free of compaction stalls.

Each received chunk becomes a new ``bytes`` object of chunk size (grpc
allocates it). glibc serves such large requests with ``mmap`` and gives the
pages back on ``free``, so every chunk page-faults its memory in again
(~2.8 GB/s here, against ~20 GB/s to reuse warm memory). Raising the mmap and
trim thresholds lets freed chunks be reused warm. Measured on the 2-core
development machine: 64 MiB all-reduce between 2 workers ~97 ms -> ~84 ms.

numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``)
for every array of 4 MiB or more. Where the kernel's THP ``defrag`` setting is
``madvise`` (a common default), ``always`` or ``defer+madvise``, a fault in
such an array compacts memory synchronously until a huge page is free: on the
development VM the first touch of a fresh 48 MiB array took 5-250 ms (median
~200 ms) with numpy's default, against 25-30 ms without it, and a joining
worker touches its whole model state for the first time in its state sync.
So, on such kernels, the worker turns numpy's request off.

Set ``EDL_TUNE_MALLOC=0`` to leave glibc and numpy as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit
_TRIM_THRESHOLD = 512 << 20
_TOP_PAD = 64 << 20

THP_DEFRAG = "/sys/kernel/mm/transparent_hugepage/defrag"
# The defrag modes under which a fault in a MADV_HUGEPAGE range compacts memory before it returns.
_STALLING_DEFRAG_MODES = frozenset({"always", "madvise", "defer+madvise"})

_tuned = False


def tune_for_streaming() -> bool:
    """Tunes glibc and numpy once per process (see the module docstring); returns whether glibc took it."""
    global _tuned
    if _tuned or os.environ.get("EDL_TUNE_MALLOC", "1") == "0":
        return _tuned
    if stalls_on_huge_page_faults(_read(THP_DEFRAG)):
        _stop_numpy_huge_pages()
    _tuned = _raise_malloc_thresholds()
    return _tuned


def stalls_on_huge_page_faults(defrag: Optional[str]) -> bool:
    """Whether the kernel's THP defrag setting (the text of ``THP_DEFRAG``) compacts memory on a fault
    in a range advised ``MADV_HUGEPAGE``; ``None`` (no such file) -> False.

    >>> stalls_on_huge_page_faults("always defer defer+madvise [madvise] never")
    True
    >>> stalls_on_huge_page_faults("always [defer] defer+madvise madvise never")
    False
    """
    if defrag is None:
        return False
    selected = [word[1:-1] for word in defrag.split() if word.startswith("[") and word.endswith("]")]
    return bool(selected) and selected[0] in _STALLING_DEFRAG_MODES


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _stop_numpy_huge_pages() -> None:
    # numpy's own switch (numpy >= 2.0; NUMPY_MADVISE_HUGEPAGE=0 does the same, but only when set
    # before numpy is imported, which a worker's model code has done long before runtime.init).
    from numpy._core import multiarray

    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is not None:
        setter(False)
        logger.debug("numpy's MADV_HUGEPAGE turned off: this kernel compacts memory on such faults")


def _raise_malloc_thresholds() -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = all(
            libc.mallopt(param, value) == 1
            for param, value in (
                (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX),
                (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
                (_M_TOP_PAD, _TOP_PAD),
            )
        )
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    if not ok:
        logger.debug("mallopt refused the streaming settings")
    return ok
