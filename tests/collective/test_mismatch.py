"""Ranks that disagree about a collective all raise CollectiveMismatchError; deadlines raise
CollectiveTimeoutError naming the missing ranks. Never a hang, never a wrong result."""

import time

import numpy as np
import pytest

from elasticdl_strategy.errors import CollectiveMismatchError, CollectiveTimeoutError
from tests.cluster import ThreadCluster, transport_options


def outcomes(n, fn, timeout=30, transport=None):
    with ThreadCluster(n, transport_options(transport) if transport else None) as cluster:
        return cluster.run_outcomes(fn, timeout=timeout)


@pytest.mark.parametrize(
    "n, odd_call, what",
    [
        (2, lambda c: c.allreduce(np.ones(5, np.float32)), "shape"),
        (3, lambda c: c.allreduce(np.ones(4, np.float64)), "dtype"),
        (3, lambda c: c.allreduce(np.ones(4, np.float32), op="max"), "reduce_op"),
        (4, lambda c: c.broadcast(np.ones(4, np.float32)), "op"),
        (3, lambda c: c.allgather(np.ones((4, 2), np.float32)), "op"),
        (3, lambda c: c.reduce_scatter(np.ones(4, np.float32)), "op"),
    ],
)
@pytest.mark.parametrize("transport", ["host-segment", "shared-memory", "data-socket"])
def test_every_rank_raises_mismatch_naming_ranks_and_difference(n, odd_call, what, transport):
    odd = n - 1

    def program(c):
        c.allreduce(np.ones(2))  # agreed: the streams are open, their lanes or data sockets in use
        if c.rank == odd:
            return odd_call(c)
        return c.allreduce(np.ones(4, np.float32))

    results = outcomes(n, program, transport=transport)
    for rank, outcome in enumerate(results):
        assert isinstance(outcome, CollectiveMismatchError), (rank, outcome)
        assert what in str(outcome)
        assert odd in outcome.ranks or f"rank {odd}" in str(outcome)


def test_agreeing_descriptors_are_compared_whole_without_listing_differences(monkeypatch):
    from elasticdl_strategy.collective import communicator

    def listed(mine, theirs):
        raise AssertionError(f"differences listed for agreeing calls: {mine} / {theirs}")

    monkeypatch.setattr(communicator, "_differences", listed)  # the slow path, per message, before
    results = outcomes(3, lambda c: c.allreduce(np.full(4, c.rank, np.float32)))
    for outcome in results:
        np.testing.assert_array_equal(outcome, np.full(4, 3, np.float32))


def test_mismatch_is_sticky_until_a_new_communicator():
    def program(c):
        shape = 3 if c.rank == 0 else 4
        try:
            c.allreduce(np.ones(shape))
        except CollectiveMismatchError:
            pass
        c.barrier()  # the communicator is aborted: raises again

    for outcome in outcomes(2, program):
        assert isinstance(outcome, CollectiveMismatchError)


def test_collective_that_one_rank_skips_times_out_on_all_ranks_naming_it():
    def program(c):
        if c.rank == 2:
            return "skipped"  # a branch only some ranks take
        return c.allreduce(np.ones(4), timeout=1.0)

    start = time.monotonic()
    results = outcomes(3, program)
    assert results[2] == "skipped"
    for rank in (0, 1):
        assert isinstance(results[rank], CollectiveTimeoutError), results[rank]
        assert "rank" in str(results[rank]) and "waiting" in str(results[rank])
    assert any(2 in r.waiting_for for r in results[:2])
    assert time.monotonic() - start < 15


def test_timeout_on_one_rank_aborts_the_others_at_once():
    def program(c):
        if c.rank == 1:
            time.sleep(3)
            return "late"
        return c.allreduce(np.ones(2), timeout=0.5 if c.rank == 0 else 20)

    start = time.monotonic()
    results = outcomes(3, program)
    assert isinstance(results[0], CollectiveTimeoutError)
    assert isinstance(results[2], CollectiveTimeoutError)  # told by rank 0, not its own 20 s deadline
    assert time.monotonic() - start < 10


def test_a_collective_waiting_long_logs_whom_it_waits_for_and_then_completes(caplog):
    from elasticdl_strategy.transport.options import TransportOptions

    options = TransportOptions(timeout_s=20.0, connect_timeout_s=5.0, slow_warning_s=0.3)

    def warned():
        return any("still waiting for rank(s) 1 (w1)" in r.getMessage() for r in caplog.records)

    def late_rank_one(comm):
        if comm.rank == 1:
            deadline = time.monotonic() + 15
            while not warned() and time.monotonic() < deadline:
                time.sleep(0.02)  # polling for rank 0's warning
        return comm.allreduce(np.ones(3, np.float32))

    with caplog.at_level("WARNING"), ThreadCluster(2, options) as cluster:
        results = cluster.run(late_rank_one)
    assert warned()
    assert all(r.tolist() == [2.0, 2.0, 2.0] for r in results)


def test_a_message_delivered_while_another_stream_thread_aborts_gets_the_abort_not_its_sink_error():
    # Two stream threads see mismatched messages at once. The first aborts; the second must not
    # hand its message to the posted receive (whose buffer does not fit it) before the channel
    # is failed, or that receive raises "holds 16 bytes ... 8" instead of the mismatch.
    import threading
    import types

    from elasticdl_strategy.collective.communicator import Communicator
    from elasticdl_strategy.collective.mailbox import ArraySink, Mailbox
    from elasticdl_strategy.collective.p2p import COLLECTIVE_CHANNEL, _InboundStream
    from elasticdl_strategy.transport.options import TransportOptions
    from elasticdl_strategy.transport.protos import peer_pb2

    failing, release = threading.Event(), threading.Event()

    class SlowAbortMailbox(Mailbox):
        def fail_channel(self, channel, make_error):
            failing.set()
            assert release.wait(10)
            super().fail_channel(channel, make_error)

    p2p = types.SimpleNamespace(
        rank=2,
        size=3,
        options=TransportOptions(),
        mailbox=SlowAbortMailbox(rank=2),
        addresses=["h:1", "h:2", "h:3"],
        membership_version=1,
        worker_ids=["w0", "w1", "w2"],
        header_observer=None,
        abort_observer=None,
        failure_observer=None,
        send_abort=lambda kind, reason, ranks: None,
    )
    comm = Communicator(p2p)
    comm._begin("allgather", np.int64, (-1,))  # this rank's collective #0: it expects int64 rows
    receive, _ = p2p.mailbox.post(1, COLLECTIVE_CHANNEL, 0, ArraySink(2, np.zeros(1, np.int64)))
    theirs = peer_pb2.CollectiveDescriptor(sequence=0, op="allreduce", dtype="float32", shape=[4], reduce_op="sum")

    def header(src):
        return peer_pb2.MessageHeader(
            channel=COLLECTIVE_CHANNEL, tag=0, sequence=0, nbytes=16, dtype="float32", shape=[4], collective=theirs
        )

    first = threading.Thread(target=lambda: _InboundStream(p2p, 0).on_header(header(0)))
    second = threading.Thread(target=lambda: _InboundStream(p2p, 1).on_header(header(1)).finish())
    first.start()
    assert failing.wait(10)
    second.start()
    second.join(0.5)  # with the race, the second thread delivers into the receive right here
    release.set()
    first.join(10)
    second.join(10)
    with pytest.raises(CollectiveMismatchError, match="called allreduce"):
        receive.result(timeout=5)
