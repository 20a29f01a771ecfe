"""Reading another process's memory (process_vm_readv): the bytes where they lie, and typed errors."""

import errno
import os

import numpy as np
import pytest

from elasticdl_strategy.transport import cross_memory
from tests.memory_holder import cross_memory_allowed, holder


def test_reads_another_processs_array_where_it_lies():
    if not cross_memory_allowed():
        pytest.skip("this machine does not let a process read another's memory")
    with holder() as (pid, address):
        into = np.zeros(250000, np.float32)  # not from the start, not the whole array: an offset and a length
        cross_memory.read(pid, address + 4 * 1000, into)
        np.testing.assert_array_equal(into, np.arange(1000, 251000, dtype=np.float32))
        cross_memory.read(pid, address, into[:0])  # nothing to read: no call


def test_a_process_that_is_gone_or_an_unmapped_address_raise_oserror():
    if not cross_memory.AVAILABLE:
        pytest.skip("no process_vm_readv here")
    with holder() as (pid, address):
        pass  # gone from here on
    with pytest.raises(OSError) as gone:
        cross_memory.read(pid, address, np.empty(4, np.float32))
    assert gone.value.errno in (errno.ESRCH, errno.EPERM)
    with pytest.raises(OSError) as unmapped:
        cross_memory.read(os.getpid(), 4096, np.empty(4, np.float32))  # the first pages are never mapped
    assert unmapped.value.errno == errno.EFAULT


def test_a_read_larger_than_one_call_takes_several(monkeypatch):
    if not cross_memory_allowed():
        pytest.skip("this machine does not let a process read another's memory")
    monkeypatch.setattr(cross_memory, "MAX_CALL_BYTES", 4096)  # the kernel's limit is 2 GiB a call
    with holder() as (pid, address):
        into = np.zeros(250001, np.float32)  # 245 calls, the last one short
        cross_memory.read(pid, address + 4 * 1000, into[:250000])
        np.testing.assert_array_equal(into[:250000], np.arange(1000, 251000, dtype=np.float32))
        assert into[250000] == 0.0


@pytest.mark.parametrize("max_pieces, max_bytes", [(1024, 1 << 30), (7, 4096), (1, 64)])
def test_many_pieces_are_read_in_as_few_calls_as_the_limits_allow(monkeypatch, max_pieces, max_bytes):
    if not cross_memory_allowed():
        pytest.skip("this machine does not let a process read another's memory")
    monkeypatch.setattr(cross_memory, "MAX_PIECES", max_pieces)
    monkeypatch.setattr(cross_memory, "MAX_CALL_BYTES", max_bytes)
    calls = []
    read_batch = cross_memory._read_batch
    monkeypatch.setattr(
        cross_memory, "_read_batch", lambda pid, batch, total: calls.append(len(batch)) or read_batch(pid, batch, total)
    )
    with holder() as (pid, address):
        starts = list(range(0, 250000, 83))  # 3013 pieces of 0 to 40 elements, in no particular order
        rng = np.random.default_rng(5)
        rng.shuffle(starts)
        pieces = [(s, np.zeros(int(rng.integers(0, 41)), np.float32)) for s in starts]
        cross_memory.read_pieces(pid, [(address + 4 * s, into) for s, into in pieces])
    for s, into in pieces:
        np.testing.assert_array_equal(into, np.arange(s, s + into.size, dtype=np.float32))
    assert max(calls) <= max_pieces
    nbytes, nonempty = sum(into.nbytes for _, into in pieces), sum(into.size > 0 for _, into in pieces)
    assert len(calls) >= max(-(-nbytes // max_bytes), -(-nonempty // max_pieces))  # nothing read for empty ones
    if max_bytes == 1 << 30:  # bytes no limit here: only full batches of pieces
        assert calls == [1024] * (nonempty // 1024) + [nonempty % 1024] * (nonempty % 1024 > 0)


@pytest.mark.slow
def test_a_read_of_more_than_2_gib_is_read_whole():
    if not cross_memory.AVAILABLE:
        pytest.skip("no process_vm_readv here")
    # The kernel copies at most 2 GiB - 4 KiB a call. Read onto itself: only the pages written
    # take memory (2 GiB for the copy, freed at the end).
    array = np.zeros((2 << 30) + 8192, np.uint8)
    array[0], array[-1] = 5, 7
    try:
        cross_memory.read(os.getpid(), array.ctypes.data, array)
        assert array[0] == 5 and array[-1] == 7 and array[1 << 31] == 0
    finally:
        del array
