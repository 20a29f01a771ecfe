"""The mailbox: where arriving bytes may go, and receives of a failed channel."""

import numpy as np
import pytest

from elasticdl_strategy.collective.mailbox import ArraySink, Mailbox, ReduceSink
from elasticdl_strategy.errors import CollectiveMismatchError, PeerFailureError
from elasticdl_strategy.transport.protos import peer_pb2


def test_bytes_go_straight_into_a_pending_receive_buffer_but_never_after_it_failed():
    mailbox = Mailbox(rank=0)
    out = np.zeros(8, np.uint8)
    mailbox.post(1, 0, 0, ArraySink(0, out))
    entry = mailbox.deliver(1, peer_pb2.MessageHeader(channel=0, tag=0, sequence=0, nbytes=8, dtype="uint8", shape=[8]))
    entry.target(2, 4)[:] = b"abcd"
    assert bytes(out) == b"\0\0abcd\0\0"
    entry.fail(PeerFailureError("gone", peer_rank=1, rank=0))
    assert entry.target(0, 8) is None
    # A reduction needs every byte through write(); so does a message with no receive yet.
    acc = np.zeros(2, np.float32)
    mailbox.post(1, 0, 1, ReduceSink(0, acc, np.add))
    reducing = mailbox.deliver(1, peer_pb2.MessageHeader(channel=0, tag=1, sequence=0, nbytes=8))
    early = mailbox.deliver(1, peer_pb2.MessageHeader(channel=0, tag=2, sequence=0, nbytes=8))
    assert reducing.target(0, 8) is None and early.target(0, 8) is None


def test_a_message_that_arrived_before_an_abort_is_not_handed_to_a_later_receive():
    # The ring posts its receives after the abort of a mismatched collective: they must raise
    # the abort's error, not whatever the early message does to their sinks.
    mailbox = Mailbox(rank=2)
    mailbox.deliver(1, peer_pb2.MessageHeader(channel=1, tag=0, sequence=0, nbytes=16)).finish()
    abort = CollectiveMismatchError("rank 2: rank 1 called allreduce but rank 2 called reduce_scatter", ranks=(1, 2))
    mailbox.fail_channel(1, lambda: abort)
    future, _ = mailbox.post(1, 1, 0, ReduceSink(2, np.zeros(2, np.float32), np.add))
    with pytest.raises(CollectiveMismatchError, match="called reduce_scatter"):
        future.result(timeout=5)
    # Another channel is unaffected.
    mailbox.deliver(
        1, peer_pb2.MessageHeader(channel=0, tag=0, sequence=0, nbytes=0, dtype="uint8", shape=[0])
    ).finish()
    assert mailbox.post(1, 0, 0, ArraySink(2))[0].result(timeout=5).size == 0


def test_a_receive_that_fails_while_the_transport_reads_into_its_buffer_completes_only_after():
    mailbox = Mailbox(rank=0)
    out = np.zeros(8, np.uint8)
    future, _ = mailbox.post(1, 0, 0, ArraySink(0, out))
    entry = mailbox.deliver(1, peer_pb2.MessageHeader(channel=0, tag=0, sequence=0, nbytes=8, dtype="uint8", shape=[8]))
    view = entry.target(0, 8)  # the transport starts reading from its socket into the buffer
    assert entry.fail(PeerFailureError("rank 1 failed", peer_rank=1, rank=0))
    assert not future.done()  # the caller must not get its buffer back while bytes may still land in it
    assert entry.target(0, 8) is None  # and nothing more is lent
    view[:] = b"late-byt"
    entry.target_done()
    with pytest.raises(PeerFailureError, match="rank 1 failed"):
        future.result(timeout=1)


@pytest.mark.parametrize("failure", ["source", "channel"])
def test_a_receive_that_took_over_a_half_arrived_message_fails_when_its_sender_does(failure):
    # The peer ran ahead: a message's header and some bytes arrived before its receive was posted,
    # then the connection broke (a cut) mid-message. The receive must fail with the sender.
    mailbox = Mailbox(rank=0)
    header = peer_pb2.MessageHeader(channel=1, tag=0, sequence=0, nbytes=8, dtype="uint8", shape=[8])
    mailbox.deliver(1, header).write(0, memoryview(b"abcd"))
    future, _ = mailbox.post(1, 1, 0, ArraySink(0, np.zeros(8, np.uint8)))
    assert not future.done() and mailbox.waiting_on(1) == {1}
    gone = PeerFailureError("rank 0: rank 1 failed: the connection broke", peer_rank=1, rank=0)
    if failure == "source":
        mailbox.fail_source(1, lambda: gone)
    else:
        mailbox.fail_channel(1, lambda: gone)
    with pytest.raises(PeerFailureError, match="the connection broke"):
        future.result(timeout=1)
    assert mailbox.waiting_on(1) == set()
