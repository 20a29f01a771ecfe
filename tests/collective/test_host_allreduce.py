"""All-reduces and barriers through a host segment: no messages, the same bits as the direct
exchange, and every failure a message path would see (a peer that left, a deadline, a mismatch);
larger ones (single copy) read where they lie, arrays or a bucket's pieces."""

import dataclasses
import errno
import os
import subprocess
import threading
import time

import numpy as np
import pytest

from elasticdl_strategy.collective import host_allreduce
from elasticdl_strategy.errors import CollectiveMismatchError, CollectiveTimeoutError, PeerFailureError, UsageError
from elasticdl_strategy.transport import futex
from tests.cluster import ThreadCluster, transport_options

pytestmark = pytest.mark.skipif(not futex.AVAILABLE, reason="host segments need Linux futexes on x86-64")


def _inputs(n, size, dtype=np.float32):
    rng = np.random.default_rng(7)
    return [rng.standard_normal(size).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_small_allreduces_and_barriers_go_through_the_segment_without_messages(n):
    inputs = _inputs(n, 1000)
    with ThreadCluster(n, transport_options("host-segment")) as cluster:
        cluster.run(lambda c: c.allreduce(inputs[c.rank]))  # sets the segment up (by messages)
        sent = [c.p2p.messages_sent for c in cluster.communicators]

        def program(c):
            results = [c.allreduce(inputs[c.rank], op=op) for op in ("sum", "max", "mean")]
            c.barrier()
            return results

        results = cluster.run(program)
        assert [c.p2p.messages_sent for c in cluster.communicators] == sent
        assert all(isinstance(c._host_segment, host_allreduce.HostAllreduce) for c in cluster.communicators)
    for r in range(1, n):  # the same bits on every rank
        for mine, theirs in zip(results[0], results[r]):
            assert mine.tobytes() == theirs.tobytes()
    expected = np.zeros(1000, np.float32)
    for x in inputs:  # rank order 0..N-1, as every rank reduces
        expected += x
    assert results[0][0].tobytes() == expected.tobytes()
    np.testing.assert_array_equal(results[0][1], np.max(inputs, axis=0))


def test_the_segment_gives_the_same_bits_as_the_direct_exchange():
    inputs = _inputs(3, 4099, np.float64)
    outcomes = []
    for transport in ("host-segment", "shared-memory"):
        with ThreadCluster(3, transport_options(transport)) as cluster:
            outcomes.append(cluster.run(lambda c: c.allreduce(inputs[c.rank]))[0].tobytes())
            assert (cluster.communicators[0]._host_segment is not None) == (transport == "host-segment")
    assert outcomes[0] == outcomes[1]


def test_without_single_copy_arrays_above_the_segments_size_go_by_messages():
    options = transport_options("host-segment", host_segment_bytes=4096, single_copy=False)
    with ThreadCluster(2, options) as cluster:
        cluster.run(lambda c: c.allreduce(np.ones(1024, np.float32)))  # 4 KiB: the segment
        sent = [c.p2p.messages_sent for c in cluster.communicators]
        results = cluster.run(lambda c: c.allreduce(np.ones(1025, np.float32)))
        assert all(c.p2p.messages_sent > s for c, s in zip(cluster.communicators, sent))
    assert all(r.tolist() == [2.0] * 1025 for r in results)


def test_no_segment_between_hosts_nor_when_one_rank_cannot_map_it(tmp_path):
    with ThreadCluster(2, transport_options("host-segment"), hosts=("a", "b")) as cluster:
        results = cluster.run(lambda c: c.allreduce(np.full(4, c.rank + 1.0)))
        assert all(c._host_segment is None for c in cluster.communicators)
    assert all(r.tolist() == [3.0] * 4 for r in results)

    elsewhere = tmp_path / "another-volume"
    elsewhere.mkdir()
    options = transport_options("host-segment")
    per_rank = [options, dataclasses.replace(options, shared_memory_dir=str(elsewhere))]
    with ThreadCluster(2, per_rank) as cluster:
        for _ in range(2):  # the ranks agreed once: never again in this membership
            results = cluster.run(lambda c: c.allreduce(np.full(4, c.rank + 1.0)))
            assert all(r.tolist() == [3.0] * 4 for r in results)
        assert all(c._host_segment is None and not c._host_segment_possible for c in cluster.communicators)
    assert [p.name for p in elsewhere.iterdir()] == []


def test_a_peer_that_leaves_while_others_wait_in_the_segment_fails_their_collective_at_once(monkeypatch):
    monkeypatch.setattr(host_allreduce, "SWEEP_S", 60.0)  # only a wake ends the sleep early

    def program(c):
        c.allreduce(np.ones(4))
        if c.rank == 2:
            time.sleep(0.5)  # the others are asleep in the segment by now
            c.close()
            return "left"
        return c.allreduce(np.ones(4))

    start = time.monotonic()
    with ThreadCluster(3, transport_options("host-segment", spin_us=0.0)) as cluster:
        results = cluster.run_outcomes(program, timeout=30)
    assert results[2] == "left"
    for outcome in results[:2]:
        assert isinstance(outcome, PeerFailureError), outcome
        assert outcome.peer_rank == 2
    assert time.monotonic() - start < 10


def test_a_rank_that_does_not_come_times_out_naming_it(monkeypatch):
    monkeypatch.setattr(host_allreduce, "SWEEP_S", 60.0)  # the deadline ends the sleep, not a sweep

    def program(c):
        c.allreduce(np.ones(4))
        if c.rank == 1:
            return "skipped"
        return c.allreduce(np.ones(4), timeout=1.0)

    start = time.monotonic()
    with ThreadCluster(3, transport_options("host-segment", spin_us=0.0)) as cluster:
        results = cluster.run_outcomes(program, timeout=30)
    for rank in (0, 2):
        assert isinstance(results[rank], CollectiveTimeoutError), results[rank]
        assert 1 in results[rank].waiting_for
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "odd_call, what",
    [
        (lambda c: c.allreduce(np.ones(5, np.float32)), "shape"),  # in the segment: its note differs
        (lambda c: c.barrier(), "op"),  # in the segment too
        (lambda c: c.broadcast(np.ones(4, np.float32), root=0), "op"),  # a receiver: sends nothing
    ],
)
def test_a_rank_in_another_collective_is_found_out_by_its_note(odd_call, what):
    def program(c):
        c.allreduce(np.ones(2))
        if c.rank == 2:
            return odd_call(c)
        return c.allreduce(np.ones(4, np.float32))

    with ThreadCluster(3, transport_options("host-segment")) as cluster:
        results = cluster.run_outcomes(program, timeout=30)
    for rank, outcome in enumerate(results):
        assert isinstance(outcome, CollectiveMismatchError), (rank, outcome)
        assert what in str(outcome)


def test_closing_the_communicator_ends_a_wait_in_the_segment(monkeypatch):
    from elasticdl_strategy.errors import CommunicatorClosedError

    monkeypatch.setattr(host_allreduce, "SWEEP_S", 60.0)
    with ThreadCluster(2, transport_options("host-segment", spin_us=0.0)) as cluster:
        cluster.run(lambda c: c.allreduce(np.ones(4)))
        first = cluster.communicators[0]
        closer = threading.Timer(0.3, first.close)
        closer.start()
        start = time.monotonic()
        with pytest.raises(CommunicatorClosedError):
            first.allreduce(np.ones(4))  # rank 1 never comes
        assert time.monotonic() - start < 10
        closer.join()
        with pytest.raises(CommunicatorClosedError):
            first.allreduce(np.ones(4))


def _pause_once(monkeypatch, obj, name, until, reached):
    """Makes ``obj.name`` (a method of one rank) set ``reached``, then wait for ``until()`` before it
    runs, the first time it is called: a thread of that rank held up there, as the scheduler may."""
    real = getattr(obj, name)
    armed = [True]

    def paused(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            reached.set()
            deadline = time.monotonic() + 10
            while not until() and time.monotonic() < deadline:
                time.sleep(0.001)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, paused)


def test_a_rank_that_arrives_finishes_and_announces_its_next_collective_during_a_sweep_is_not_blamed(monkeypatch):
    monkeypatch.setattr(host_allreduce, "SWEEP_S", 0.05)
    with ThreadCluster(2, transport_options("host-segment", spin_us=0.0)) as cluster:
        cluster.run(lambda c: c.allreduce(np.ones(4)))  # sets the segment up
        segment = cluster.communicators[0]._host_segment._segment
        announced = segment.current(1)
        in_sweep = threading.Event()
        # Rank 0 has read that rank 1 is missing and sweeps; meanwhile rank 1 comes, finishes the
        # all-reduce and announces a broadcast (#3, later than rank 0's all-reduce #2).

        def announced_next():
            return segment.current(1) not in (announced, b"")

        _pause_once(monkeypatch, cluster.communicators[0].p2p, "sweep_lanes", announced_next, in_sweep)

        def program(c):
            if c.rank == 1:
                assert in_sweep.wait(10)
            total = c.allreduce(np.full(4, c.rank + 1.0))
            return total.tolist(), c.broadcast(np.full(2, c.rank + 5.0), root=0).tolist()

        results = cluster.run_outcomes(program, timeout=30)
    assert results == [([3.0] * 4, [5.0] * 2)] * 2, results


def test_a_rank_that_arrives_finishes_and_leaves_before_the_failure_check_is_not_blamed(monkeypatch):
    with ThreadCluster(2, transport_options("host-segment", spin_us=0.0)) as cluster:
        cluster.run(lambda c: c.allreduce(np.ones(4)))
        p2p = cluster.communicators[0].p2p
        waiting = threading.Event()
        # Rank 0 has read that rank 1 is missing; before it looks for failed peers, rank 1 comes,
        # finishes and closes (a clean leave, which rank 0 records as rank 1 having left).
        _pause_once(monkeypatch, p2p, "raise_if_failed", lambda: 1 in p2p._failed, waiting)

        def program(c):
            if c.rank == 1:
                assert waiting.wait(10)
                total = c.allreduce(np.full(4, 2.0))
                c.close()
                return total.tolist()
            return c.allreduce(np.full(4, 1.0)).tolist()

        results = cluster.run_outcomes(program, timeout=30)
    assert results == [[3.0] * 4] * 2, results


@pytest.mark.parametrize(
    "sizes, slots",
    [
        ((4096, 8192, 4096), 4096),
        ((8192, 4096, 8192), 4096),
        ((4096, 0, 4096), None),
        ((4096, 4096, None), None),
        (("default", 8192, "default"), 8192),  # a size asked for wins over the default
    ],
)
def test_ranks_whose_options_differ_agree_on_one_segment_or_none(sizes, slots):
    # host_segment_bytes per rank (None: no shared memory at all). A rank that took 8 KiB through
    # a segment of 4 KiB slots wrote into the next rank's slot; one that took none while the others
    # set one up failed the call with a mismatch.
    base = transport_options("host-segment", timeout_s=5.0)
    options = [
        dataclasses.replace(base, shared_memory=False)
        if size is None
        else dataclasses.replace(base, host_segment_bytes=None if size == "default" else size)
        for size in sizes
    ]
    with ThreadCluster(3, options) as cluster:

        def program(c):
            return [c.allreduce(np.full(n, c.rank + 1.0, np.float32)).tolist() for n in (1500, 4, 4, 1500, 4)]

        results = cluster.run(program)
        found = {c._host_segment.slot_bytes if c._host_segment else None for c in cluster.communicators}
    assert found == {slots}
    for n, result in zip((1500, 4, 4, 1500, 4), results[0]):
        assert result == [6.0] * n
    assert results[1] == results[2] == results[0]


def test_a_descriptor_too_long_for_a_note_is_announced_as_none():
    from elasticdl_strategy.transport.host_segment import NOTE_BYTES

    with ThreadCluster(2, transport_options("host-segment")) as cluster:
        cluster.run(lambda c: c.allreduce(np.ones(4)))
        mine = cluster.communicators[0]._host_segment
        mine.announce(b"x" * (NOTE_BYTES + 1))
        assert cluster.communicators[1]._host_segment._segment.current(0) == b""
        results = cluster.run(lambda c: c.allreduce(np.full(4, c.rank + 1.0)))  # the segment still works
    assert all(r.tolist() == [3.0] * 4 for r in results)


def test_no_room_for_the_segment_means_messages_for_every_rank(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # /dev/shm full: a write into the file would SIGBUS
    with ThreadCluster(2, transport_options("host-segment")) as cluster:
        results = cluster.run(lambda c: c.allreduce(np.full(4, c.rank + 1.0)))
        assert all(c._host_segment is None and not c._host_segment_possible for c in cluster.communicators)
    assert all(r.tolist() == [3.0] * 4 for r in results)


def test_which_all_reduces_split_and_the_parts_of_each_rank():
    assert not host_allreduce.splits(256 << 10, 2)  # two ranks read two slots either way
    assert host_allreduce.splits(256 << 10, 3) and not host_allreduce.splits((256 << 10) - 4, 3)
    assert host_allreduce.splits(16 << 10, 18) and not host_allreduce.splits(4 << 10, 16)
    for size, ranks in [(10, 4), (3, 4), (65533, 16), (0, 3)]:
        bounds = host_allreduce.parts(size, ranks)
        assert bounds[0] == 0 and bounds[-1] == size and bounds == sorted(bounds) and len(bounds) == ranks + 1


@pytest.mark.parametrize("n", [3, 4])
def test_larger_allreduces_split_the_reduction_among_the_ranks_and_give_the_same_bits(n):
    # Interleaved with calls that do not split, so that slots and arrivals alternate unevenly.
    calls = [(65536, np.float32), (1000, np.float32), (65533, np.float32), (0, None), (32768, np.float64)]
    inputs = {size: _inputs(n, size, dtype) for size, dtype in calls if dtype is not None}
    with ThreadCluster(n, transport_options("host-segment")) as cluster:
        cluster.run(lambda c: c.barrier())  # sets the segment up

        def program(c):
            before, results = c._host_segment._count, []
            for size, dtype in calls:
                if dtype is None:
                    c.barrier()
                else:
                    results.append(c.allreduce(inputs[size][c.rank]))
            return c._host_segment._count - before, results

        outcomes = cluster.run(program)
    # A split takes two arrivals. The two calls of 256 KiB split; at N = 4 also the one just under.
    splitting = {3: 2, 4: 3}[n]
    assert [arrivals for arrivals, _ in outcomes] == [len(calls) + splitting] * n
    sizes = [size for size, dtype in calls if dtype is not None]
    for i, size in enumerate(sizes):
        expected = inputs[size][0] + inputs[size][1]
        for x in inputs[size][2:]:  # rank order 0..N-1, as every rank reduces
            expected += x
        for _, results in outcomes:
            assert results[i].tobytes() == expected.tobytes(), (size, i)


def test_a_peer_that_leaves_between_the_two_rounds_of_a_split_fails_the_others_at_once():
    with ThreadCluster(3, transport_options("host-segment", spin_us=0.0)) as cluster:
        cluster.run(lambda c: c.barrier())
        leaver = cluster.communicators[2]

        def leave(*args):  # rank 2 has arrived with its slot, then leaves instead of reducing its part
            leaver.close()
            raise RuntimeError("left between the rounds")

        leaver._host_segment._reduce_split = leave
        start = time.monotonic()
        outcomes = cluster.run_outcomes(lambda c: c.allreduce(np.ones(65536, np.float32)), timeout=30)
    assert "left between the rounds" in str(outcomes[2])
    for outcome in outcomes[:2]:
        assert isinstance(outcome, PeerFailureError) and outcome.peer_rank == 2, outcome
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("n, slot", [(3, 256 << 10), (4, 4 << 20)])
def test_by_default_four_ranks_or_more_take_all_reduces_of_a_few_mib_through_the_segment(n, slot):
    inputs = _inputs(n, 1 << 18)  # 1 MiB of float32
    # Without single copy, which would take any size through the segment.
    with ThreadCluster(n, transport_options("host-segment", single_copy=False)) as cluster:
        cluster.run(lambda c: c.barrier())  # sets the segment up
        sent = [c.p2p.messages_sent for c in cluster.communicators]
        results = cluster.run(lambda c: c.allreduce(inputs[c.rank]))
        assert {c._host_segment.slot_bytes for c in cluster.communicators} == {slot}
        by_messages = [c.p2p.messages_sent for c in cluster.communicators] != sent
    assert by_messages == (n < 4)  # at N = 3 the ring
    expected = inputs[0] + inputs[1]
    for x in inputs[2:]:
        expected += x
    for r in results:
        assert r.tobytes() == results[0].tobytes()
        np.testing.assert_allclose(r, expected, rtol=1e-5, atol=1e-5)
    if n >= 4:  # rank order 0..N-1, as every rank reduces its part
        assert results[0].tobytes() == expected.tobytes()


def test_without_room_for_large_slots_the_default_segment_has_small_ones(monkeypatch):
    real = os.posix_fallocate

    def room_for_8_mib_of_segment(fd, offset, length):
        if "edl-segment-" in os.readlink(f"/proc/self/fd/{fd}") and offset + length > 8 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", room_for_8_mib_of_segment)  # 4 ranks x 2 x 4 MiB do not fit
    with ThreadCluster(4, transport_options("host-segment")) as cluster:
        results = cluster.run(lambda c: c.allreduce(np.full(1 << 18, c.rank + 1.0, np.float32)))
        assert {c._host_segment.slot_bytes for c in cluster.communicators} == {256 << 10}
        sent = [c.p2p.messages_sent for c in cluster.communicators]
        cluster.run(lambda c: c.allreduce(np.full(1000, c.rank + 1.0, np.float32)))
        assert [c.p2p.messages_sent for c in cluster.communicators] == sent  # small ones: the segment
    assert all(r.tolist() == [10.0] * (1 << 18) for r in results)


# ---- single copy: all-reduces larger than a slot, read where they lie ---------------------------


def _reference(inputs, ufunc=np.add):
    """The inputs reduced in rank order 0..N-1, as the segment reduces (the bits to expect)."""
    expected = ufunc(inputs[0], inputs[1])
    for x in inputs[2:]:
        expected = ufunc(expected, x)
    return expected


@pytest.mark.parametrize("n", [2, 3, 4])
def test_larger_allreduces_are_read_where_they_lie_in_three_rounds_without_messages(monkeypatch, n):
    monkeypatch.setattr(host_allreduce, "READ_CHUNK_BYTES", 4096)  # parts of several chunks, the last one short
    calls = [
        (10_001, np.float32, "sum", False),
        (3000, np.float64, "sum", True),  # out= a new array: the input stays as it was
        (1000, np.float32, "sum", False),  # in a slot, between the others: slots and arrivals interleave
        (2049, np.int64, "max", False),
        (5003, np.float64, "prod", False),
    ]
    inputs = {size: _inputs(n, size, dtype) for size, dtype, _, _ in calls}
    options = transport_options("host-segment", host_segment_bytes=8192)
    with ThreadCluster(n, options) as cluster:
        cluster.run(lambda c: c.barrier())  # sets the segment up
        assert all(c._host_segment.single_copy for c in cluster.communicators)
        sent = [c.p2p.messages_sent for c in cluster.communicators]

        def program(c):
            before, results = c._host_segment._count, []
            for size, dtype, op, out in calls:
                mine = inputs[size][c.rank].copy()
                results.append(c.allreduce(mine, op=op, out=np.empty_like(mine) if out else mine))
                assert not out or mine.tobytes() == inputs[size][c.rank].tobytes()
            return c._host_segment._count - before, results

        outcomes = cluster.run(program)
        assert [c.p2p.messages_sent for c in cluster.communicators] == sent
    in_slots = sum(size * np.dtype(dtype).itemsize <= 8192 for size, dtype, _, _ in calls)
    assert [arrivals for arrivals, _ in outcomes] == [in_slots + 3 * (len(calls) - in_slots)] * n
    for i, (size, _, op, _) in enumerate(calls):
        expected = _reference(inputs[size], {"sum": np.add, "max": np.maximum, "prod": np.multiply}[op])
        for _, results in outcomes:  # every rank: the same bits, those of the reduction in rank order
            assert results[i].tobytes() == expected.tobytes(), (size, op)


def test_ranks_that_cannot_read_each_other_all_go_by_messages(monkeypatch):
    def refused(pid, address, into):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    options = transport_options("host-segment", host_segment_bytes=4096)
    no_single_copy = dataclasses.replace(options, single_copy=False)
    inputs = _inputs(3, 5000)
    for per_rank, patch in (([options, no_single_copy, options], False), ([options] * 3, True)):
        if patch:  # the kernel forbids reading another process (a policy against tracing)
            monkeypatch.setattr(host_allreduce.cross_memory, "read", refused)
        with ThreadCluster(3, per_rank) as cluster:
            cluster.run(lambda c: c.barrier())
            assert not any(c._host_segment.single_copy for c in cluster.communicators)
            sent = [c.p2p.messages_sent for c in cluster.communicators]
            results = cluster.run(lambda c: c.allreduce(inputs[c.rank]))
            assert all(c.p2p.messages_sent > s for c, s in zip(cluster.communicators, sent))
        for result in results:
            np.testing.assert_allclose(result, inputs[0] + inputs[1] + inputs[2], rtol=1e-6)
            assert result.tobytes() == results[0].tobytes()


def test_ranks_that_disagree_on_a_larger_allreduce_all_raise_mismatch():
    def program(c):
        c.barrier()
        return c.allreduce(np.ones(5000 if c.rank == 1 else 5001, np.float32))

    with ThreadCluster(3, transport_options("host-segment", host_segment_bytes=4096)) as cluster:
        results = cluster.run_outcomes(program, timeout=30)
    for rank, outcome in enumerate(results):
        assert isinstance(outcome, CollectiveMismatchError), (rank, outcome)
        assert "shape" in str(outcome)


@pytest.mark.parametrize("where", ["_reduce_part", "read"])
def test_a_peer_that_leaves_or_cannot_be_read_during_a_larger_allreduce_fails_the_others_at_once(where):
    with ThreadCluster(3, transport_options("host-segment", host_segment_bytes=4096, spin_us=0.0)) as cluster:
        cluster.run(lambda c: c.barrier())
        leaver = cluster.communicators[2]
        if where == "_reduce_part":

            def leave(*args):  # rank 2 has published where its array lies, then leaves instead of reducing
                leaver.close()
                raise RuntimeError("left between the rounds")

            leaver._host_segment._reduce_part = leave
        else:  # rank 0 finds rank 2's process gone when it reads (every rank is this process here)
            gone = subprocess.Popen(["true"])  # noqa: S607
            gone.wait()
            cluster.communicators[0]._host_segment._pids[2] = gone.pid
        start = time.monotonic()
        outcomes = cluster.run_outcomes(lambda c: c.allreduce(np.ones(5000, np.float32)), timeout=30)
    if where == "_reduce_part":
        assert "left between the rounds" in str(outcomes[2])
        for outcome in outcomes[:2]:
            assert isinstance(outcome, PeerFailureError) and outcome.peer_rank == 2, outcome
    else:
        assert isinstance(outcomes[0], PeerFailureError) and "cannot read rank 2" in str(outcomes[0]), outcomes[0]
        for outcome in outcomes:  # rank 0 aborted the call on every rank
            assert isinstance(outcome, PeerFailureError) and outcome.peer_rank == 2, outcome
    assert time.monotonic() - start < 10


def test_a_rank_that_gives_up_while_others_read_its_array_fails_their_call():
    # Rank 2 publishes its last arrival, then gives up (its wait raises; not a failure that aborts
    # the others) while ranks 0 and 1 still read its array: they must not return what they read.
    given_up = threading.Event()
    with ThreadCluster(3, transport_options("host-segment", host_segment_bytes=4096)) as cluster:
        cluster.run(lambda c: c.barrier())
        segments = [c._host_segment for c in cluster.communicators]
        last_arrival = segments[2]._count + 3
        real_wait, real_abandon = segments[2]._wait, segments[2]._segment.abandon

        def wait(call, count, *args):
            if count == last_arrival:
                raise RuntimeError("gave up")
            return real_wait(call, count, *args)

        def abandon(count):
            real_abandon(count)
            given_up.set()

        segments[2]._wait, segments[2]._segment.abandon = wait, abandon
        for segment in segments[:2]:
            reduced = []

            def reduce_part(*args, segment=segment, reduced=reduced, real=segment._reduce_part):
                real(*args)
                reduced.append(True)

            def read(*args, reduced=reduced, real=segment._read):
                real(*args)
                if reduced:  # the second round: rank 2 gives up in the middle of it
                    given_up.wait(10)

            segment._reduce_part, segment._read = reduce_part, read
        outcomes = cluster.run_outcomes(lambda c: c.allreduce(np.ones(5000, np.float32)), timeout=30)
    assert "gave up" in str(outcomes[2])
    for outcome in outcomes[:2]:
        assert isinstance(outcome, PeerFailureError) and outcome.peer_rank == 2, outcome
        assert "gave up the all-reduce" in str(outcome)


def test_a_pid_that_names_another_process_here_is_found_out(monkeypatch):
    # As across PID namespaces: every probe read reaches the same place (the first one read), which
    # holds what the rank that published it wrote, not what the others published.
    real = host_allreduce.cross_memory.read
    first = []

    def read_the_first_place(pid, address, into):
        first.append(address)
        real(pid, first[0], into)

    monkeypatch.setattr(host_allreduce.cross_memory, "read", read_the_first_place)
    with ThreadCluster(3, transport_options("host-segment", host_segment_bytes=4096)) as cluster:
        cluster.run(lambda c: c.barrier())
        assert not any(c._host_segment.single_copy for c in cluster.communicators)
        results = cluster.run(lambda c: c.allreduce(np.full(5000, c.rank + 1.0, np.float32)))
    assert all(r.tolist() == [6.0] * 5000 for r in results)


def test_a_rank_that_gives_up_before_its_last_arrival_and_calls_again_fails_the_others_call():
    # Rank 1 gives up after its second arrival (not a failure that aborts), changes its array and
    # calls again: that call's first arrival is the one rank 0 waits for last in the first call.
    reducing, resumed = threading.Event(), threading.Event()
    with ThreadCluster(2, transport_options("host-segment", host_segment_bytes=4096)) as cluster:
        cluster.run(lambda c: c.barrier())
        segments = [c._host_segment for c in cluster.communicators]
        second_arrival = segments[1]._count + 2
        real_wait, real_reduce_part = segments[1]._wait, segments[0]._reduce_part

        def wait(call, count, *args):
            if count == second_arrival:
                raise RuntimeError("gave up")
            return real_wait(call, count, *args)

        def reduce_part(*args):  # rank 0 reads rank 1's array only once rank 1 has moved on
            reducing.set()
            resumed.wait(10)
            real_reduce_part(*args)

        segments[1]._wait, segments[0]._reduce_part = wait, reduce_part
        # Rank 1's second call finds rank 0 in its first and aborts: that message comes too late here.
        cluster.communicators[1].p2p.send_abort = lambda *args: None

        def program(c):
            mine = np.ones(5000, np.float32)
            if c.rank == 0:
                return c.allreduce(mine, out=mine)
            try:
                c.allreduce(mine, out=mine)
            except RuntimeError:
                reducing.wait(10)  # rank 0 is past its first arrival's checks
                mine[:] = 1000.0
                resumed.set()
            return c.allreduce(mine, out=mine)

        outcomes = cluster.run_outcomes(program, timeout=30)
    # Rank 0 fails instead of returning what it read from rank 1's changed array.
    assert isinstance(outcomes[0], PeerFailureError) and outcomes[0].peer_rank == 1, outcomes[0]
    assert "gave up the all-reduce" in str(outcomes[0])


# ---- all-reduces of pieces: a bucket's tensors, read where they lie -------------------------------


def _layout(sizes, gap=3):
    """Offsets of pieces of ``sizes`` with ``gap`` elements between them (as a bucket's alignment leaves)."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size + gap
    return offsets, at


def _packed(pieces, offsets, length, dtype):
    packed = np.zeros(length, dtype)
    for piece, offset in zip(pieces, offsets):
        packed[offset : offset + piece.size] = piece.reshape(-1)
    return packed


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduces_of_pieces_read_them_where_they_lie_with_the_bits_of_packing_them(monkeypatch, n):
    monkeypatch.setattr(host_allreduce, "READ_CHUNK_BYTES", 4096)  # chunks across pieces and within one
    sizes = [2500, 0, 7, 1, 3000, 1024]  # pieces of one chunk, of several, and none at all
    offsets, length = _layout(sizes)
    calls = [(np.float32, "sum"), (np.float64, "max"), (np.int64, "sum")]
    rng = np.random.default_rng(3)
    pieces = {
        dtype: [[(rng.standard_normal(s) * 100).astype(dtype).reshape(-1, 1) for s in sizes] for _ in range(n)]
        for dtype, _ in calls
    }
    with ThreadCluster(n, transport_options("host-segment", host_segment_bytes=8192)) as cluster:
        cluster.run(lambda c: c.barrier())
        assert all(c.reads_pieces(length * 8, len(sizes)) for c in cluster.communicators)
        sent = [c.p2p.messages_sent for c in cluster.communicators]

        def program(c):
            before, results = c._host_segment._count, []
            for dtype, op in calls:
                mine = [p.copy() for p in pieces[dtype][c.rank]]
                out = np.full(length, 7, dtype)
                assert c.allreduce_pieces(mine, offsets, out, op=op) is out
                assert all(a.tobytes() == b.tobytes() for a, b in zip(mine, pieces[dtype][c.rank]))  # read only
                results.append(out)
            return c._host_segment._count - before, results

        outcomes = cluster.run(program)
        assert [c.p2p.messages_sent for c in cluster.communicators] == sent
    assert [arrivals for arrivals, _ in outcomes] == [3 * len(calls)] * n
    for i, (dtype, op) in enumerate(calls):
        ufunc = {"sum": np.add, "max": np.maximum}[op]
        expected = _reference([_packed(p, offsets, length, dtype) for p in pieces[dtype]], ufunc)
        for _, results in outcomes:  # the bits of packing and reducing in rank order, 0 between pieces
            assert results[i].tobytes() == expected.tobytes(), (dtype, op)


@pytest.mark.parametrize("why", ["no single copy", "in a slot", "too many pieces for a slot's table"])
def test_allreduces_of_pieces_the_segment_does_not_read_in_place_are_packed(why):
    options = transport_options("host-segment", host_segment_bytes=4096)
    if why == "no single copy":
        options = dataclasses.replace(options, single_copy=False)
    sizes = [300] * 3 if why == "in a slot" else [2] * 200 if why.startswith("too many") else [1000, 2000]
    offsets, length = _layout(sizes)
    with ThreadCluster(3, options) as cluster:
        cluster.run(lambda c: c.barrier())
        assert not any(c.reads_pieces(length * 4, len(sizes)) for c in cluster.communicators)
        results = cluster.run(
            lambda c: c.allreduce_pieces(
                [np.full(s, c.rank + 1.0, np.float32) for s in sizes], offsets, np.zeros(length, np.float32)
            )
        )
    for result in results:
        for size, offset in zip(sizes, offsets):
            assert result[offset : offset + size].tolist() == [6.0] * size


def test_ranks_that_disagree_on_reading_pieces_all_raise_mismatch():
    def program(c):
        c.barrier()
        out = np.zeros(5000, np.float32)
        if c.rank == 1:  # the same shape, packed by the caller
            return c.allreduce(out, out=out)
        return c.allreduce_pieces([np.ones(2000, np.float32), np.ones(2000, np.float32)], [0, 3000], out)

    _every_rank_raises_mismatch(program, "allreduce_pieces")


def test_ranks_that_pass_different_numbers_of_pieces_all_raise_mismatch():
    def program(c):
        c.barrier()
        pieces = [np.ones(2000, np.float32)] * (2 if c.rank == 1 else 3)
        return c.allreduce_pieces(pieces, [0, 2000, 4000][: len(pieces)], np.zeros(6000, np.float32))

    _every_rank_raises_mismatch(program, "shape")


def _every_rank_raises_mismatch(program, naming: str) -> None:
    """Runs ``program`` on 3 ranks (slots of 4 KiB): each raises CollectiveMismatchError naming ``naming``."""
    with ThreadCluster(3, transport_options("host-segment", host_segment_bytes=4096)) as cluster:
        results = cluster.run_outcomes(program, timeout=30)
    for rank, outcome in enumerate(results):
        assert isinstance(outcome, CollectiveMismatchError), (rank, outcome)
        assert naming in str(outcome)


def test_a_peer_whose_process_is_gone_fails_an_allreduce_of_pieces_at_once():
    with ThreadCluster(3, transport_options("host-segment", host_segment_bytes=4096, spin_us=0.0)) as cluster:
        cluster.run(lambda c: c.barrier())
        gone = subprocess.Popen(["true"])  # noqa: S607
        gone.wait()
        cluster.communicators[0]._host_segment._pids[2] = gone.pid  # every rank is this process here
        start = time.monotonic()
        outcomes = cluster.run_outcomes(
            lambda c: c.allreduce_pieces([np.ones(3000, np.float32)], [100], np.zeros(5000, np.float32)), timeout=30
        )
    assert isinstance(outcomes[0], PeerFailureError) and "cannot read rank 2" in str(outcomes[0]), outcomes[0]
    for outcome in outcomes:  # rank 0 aborted the call on every rank
        assert isinstance(outcome, PeerFailureError) and outcome.peer_rank == 2, outcome
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "pieces, offsets, out, message",
    [
        ([np.ones(4, np.float32)] * 2, [0, 3], np.zeros(10, np.float32), "overlaps"),
        ([np.ones(4, np.float32)], [8], np.zeros(10, np.float32), "beyond out"),
        ([np.ones(4, np.float64)], [0], np.zeros(10, np.float32), "dtype"),
        ([np.ones((4, 2), np.float32)[:, 0]], [0], np.zeros(10, np.float32), "C-contiguous"),
        ([np.ones(4, np.float32)], [0, 4], np.zeros(10, np.float32), "offsets"),
        ([np.ones(4, np.float32)], [0], np.zeros((2, 5), np.float32), "1-D"),
        ([np.ones(4, np.float32)], [1.5], np.zeros(10, np.float32), "integer"),
    ],
)
def test_pieces_that_do_not_fit_out_are_refused_in_one_line(pieces, offsets, out, message):
    with ThreadCluster(1, transport_options("host-segment")) as cluster:
        with pytest.raises(UsageError, match=message):
            cluster.communicators[0].allreduce_pieces(pieces, offsets, out)
