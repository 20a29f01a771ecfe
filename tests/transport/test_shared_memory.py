"""The same-host shared-memory path: arenas, negotiation, fallback to gRPC, identical results."""

import errno
import mmap
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.options import TransportOptions
from elasticdl_strategy.transport.protos import peer_pb2
from elasticdl_strategy.transport.shared_memory import NAME_PREFIX, STALE_AFTER_S, ReceiveArena, SendArena
from tests.cluster import ThreadCluster
from tests.launch import REPO_ROOT

SLOT = 64 << 10


def _options(directory, **overrides) -> TransportOptions:
    settings = dict(
        timeout_s=20.0,
        connect_timeout_s=5.0,
        shared_memory_dir=str(directory),
        shm_slot_size=SLOT,
        shm_slots=4,
        shm_lane_bytes=0,  # the slots and the stream (lanes: test_lanes.py, tests/collective/test_p2p.py)
        inline_threshold=1024,
    )
    settings.update(overrides)
    return TransportOptions(**settings)


def _arenas_left(directory):
    return [name for name in os.listdir(directory) if name.startswith(NAME_PREFIX)]


# ---- arenas ----------------------------------------------------------------------------------


def test_a_receiver_maps_the_offered_arena_reads_its_slots_and_the_file_is_unlinked(tmp_path):
    sender = SendArena(str(tmp_path), slots=2, slot_size=SLOT)
    data = np.arange(SLOT // 4, dtype=np.float32)
    assert sender.fill(1, memoryview(data).cast("B")) == SLOT
    receiver, refusal = ReceiveArena.open(str(tmp_path), sender.offer())
    assert refusal == "" and receiver is not None
    with receiver.view(peer_pb2.SharedChunk(slot=1, nbytes=SLOT)) as view:
        np.testing.assert_array_equal(np.frombuffer(view, np.float32), data)
    assert _arenas_left(tmp_path) == []
    with pytest.raises(ValueError, match="outside the arena"):
        receiver.view(peer_pb2.SharedChunk(slot=2, nbytes=8))
    with pytest.raises(ValueError, match="outside the arena"):
        receiver.view(peer_pb2.SharedChunk(slot=0, nbytes=SLOT + 1))
    receiver.close()


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (lambda o: setattr(o, "nonce", b"x" * 16), "not the sender's arena"),
        (lambda o: setattr(o, "name", "../../etc/passwd"), "invalid arena name"),
        (lambda o: setattr(o, "name", NAME_PREFIX + "1-0123456789abcdef"), "cannot open"),
        (lambda o: setattr(o, "slots", 3), "wrong size"),
        (lambda o: setattr(o, "slot_size", 100), "invalid arena geometry"),
    ],
    ids=["wrong-nonce", "path-traversal", "missing-file", "wrong-size", "bad-geometry"],
)
def test_a_receiver_refuses_an_arena_it_cannot_verify(tmp_path, tamper, reason):
    sender = SendArena(str(tmp_path), slots=2, slot_size=SLOT)
    offer = sender.offer()
    tamper(offer)
    arena, refusal = ReceiveArena.open(str(tmp_path), offer)
    assert arena is None and reason in refusal
    sender.unlink()


def test_shared_memory_settings_are_validated_with_one_line_errors():
    with pytest.raises(ConfigError, match="shm_slot_size=1000"):
        TransportOptions(shm_slot_size=1000)
    with pytest.raises(ConfigError, match="shm_slots=1 "):
        TransportOptions(shm_slots=1)
    with pytest.raises(ConfigError, match="EDL_SHARED_MEMORY='yes'"):
        TransportOptions.from_env({"EDL_SHARED_MEMORY": "yes"})
    options = TransportOptions.from_env({"EDL_SHARED_MEMORY": "0", "EDL_SHM_DIR": "/x", "EDL_SHM_SLOTS": "3"})
    assert (options.shared_memory, options.shared_memory_dir, options.shm_slots) == (False, "/x", 3)


# ---- collectives over shared memory ------------------------------------------------------------


def _allreduce_on(cluster, array_for_rank):
    return cluster.run(lambda c: c.allreduce(array_for_rank(c.rank), op="sum"))


@pytest.mark.parametrize("n", [2, 3])
def test_same_host_peers_send_payloads_through_shared_memory_with_identical_results(tmp_path, n):
    rng = np.random.default_rng(n)
    # Segments of 2-3 MiB: above the size that goes raw on the data socket; many slots, uneven.
    inputs = [rng.standard_normal(1_500_001).astype(np.float32) for _ in range(n)]
    # Ranks said to be on hosts of their own: no host segment to agree on (a message to every peer).
    hosts = [f"host-{r}" for r in range(n)]
    with ThreadCluster(n, _options(tmp_path), hosts=hosts) as cluster:
        shm = _allreduce_on(cluster, lambda r: inputs[r].copy())
        for comm in cluster.communicators:
            peers = comm.p2p.shared_memory_peers
            assert peers == sorted({(comm.rank + 1) % n}), peers  # the ring sends to the right neighbour
            assert comm.p2p.data_socket_peers == peers  # which carries the frames naming slots
            assert comm.p2p.shared_bytes_sent == comm.p2p.bytes_sent > 0
        assert _arenas_left(tmp_path) == []  # unlinked once mapped
    with ThreadCluster(n, _options(tmp_path, shared_memory=False), hosts=hosts) as cluster:
        without_shm = _allreduce_on(cluster, lambda r: inputs[r].copy())
        assert all(c.p2p.shared_memory_peers == [] and c.p2p.shared_bytes_sent == 0 for c in cluster.communicators)
    with ThreadCluster(n, _options(tmp_path, data_socket=False), hosts=hosts) as cluster:
        on_grpc = _allreduce_on(cluster, lambda r: inputs[r].copy())
        assert all(c.p2p.data_socket_peers == [] for c in cluster.communicators)
        assert all(c.p2p.shared_bytes_sent == c.p2p.bytes_sent > 0 for c in cluster.communicators)
    for r in range(n):
        np.testing.assert_array_equal(shm[r], shm[0])
        np.testing.assert_array_equal(shm[r], without_shm[r])  # same ring order: bitwise the same sums
        np.testing.assert_array_equal(shm[r], on_grpc[r])


def test_small_payloads_go_raw_on_the_data_socket_and_large_ones_through_the_arena(tmp_path):
    with ThreadCluster(2, _options(tmp_path)) as cluster:
        sender, receiver = (c.p2p for c in cluster.communicators)
        small, large = np.arange(1 << 18, dtype=np.float32), np.arange((1 << 19) + 1, dtype=np.float32)
        sender.isend(small, dst=1).wait(timeout=20)
        np.testing.assert_array_equal(receiver.recv(src=0, timeout=20), small)
        assert sender.shared_memory_peers == [1] and sender.shared_bytes_sent == 0  # 1 MiB: raw on the socket
        sender.isend(large, dst=1).wait(timeout=20)
        np.testing.assert_array_equal(receiver.recv(src=0, timeout=20), large)
        assert sender.shared_bytes_sent == large.nbytes


def test_a_message_sent_before_its_receive_is_posted_survives_slot_reuse(tmp_path):
    with ThreadCluster(2, _options(tmp_path)) as cluster:
        sender, receiver = (c.p2p for c in cluster.communicators)
        # 6 x 19 slots through 4 slots (each message above the size that goes raw on the data socket)
        messages = [np.full(((1 << 20) + 3 * SLOT) // 8, i, np.float64) for i in range(6)]
        for i, m in enumerate(messages):
            sender.isend(m, dst=1, tag=i).wait(timeout=20)  # all buffered at the receiver: none posted
        assert sender.shared_memory_peers == [1] and sender.shared_bytes_sent == sum(m.nbytes for m in messages)
        for i in reversed(range(6)):
            np.testing.assert_array_equal(receiver.recv(src=0, tag=i, timeout=20), messages[i])


def test_peers_that_cannot_see_each_others_arena_use_the_data_socket(tmp_path):
    # Each rank has its own shared-memory directory, as on two hosts: offers are refused.
    options = [_options(tmp_path / f"host{r}") for r in range(2)]
    for o in options:
        os.makedirs(o.shared_memory_dir)
    with ThreadCluster(2, options) as cluster:
        data = np.arange(200_000, dtype=np.float32)
        for result in cluster.run(lambda c: c.allreduce(data * (c.rank + 1))):
            np.testing.assert_array_equal(result, data * 3)
        for c in cluster.communicators:
            assert c.p2p.shared_memory_peers == [] and c.p2p.shared_bytes_sent == 0
            assert c.p2p.data_socket_peers == [1 - c.rank]  # as between hosts: the data socket
    assert _arenas_left(options[0].shared_memory_dir) == _arenas_left(options[1].shared_memory_dir) == []


def test_creating_an_arena_removes_arenas_abandoned_long_ago_and_nothing_else(tmp_path):
    stale, fresh, other = "edl-arena-123-0123456789abcdef", "edl-arena-456-fedcba9876543210", "edl-arena-notes"
    for name in (stale, fresh, other):
        (tmp_path / name).write_bytes(b"x")
    long_ago = time.time() - STALE_AFTER_S - 60
    for name in (stale, other):
        os.utime(tmp_path / name, (long_ago, long_ago))
    arena = SendArena(str(tmp_path), slots=2, slot_size=SLOT)
    left = sorted(os.listdir(tmp_path))
    assert stale not in left and fresh in left and other in left and arena.name in left
    arena.unlink()


def test_a_stream_closed_on_purpose_lets_go_of_its_life_mark_before_its_goodbye(tmp_path, monkeypatch):
    from elasticdl_strategy.transport import byte_paths, life_marks

    if not life_marks.AVAILABLE:
        pytest.skip("life marks need Linux, glibc and x86-64")
    released_at_goodbye = []
    goodbye = byte_paths.DataSocketPath.goodbye

    def recording_goodbye(self, message):  # what the peer's watcher sees when the goodbye goes out
        released_at_goodbye.append(self.shared.arena._mark._released.is_set())
        yield from goodbye(self, message)

    monkeypatch.setattr(byte_paths.DataSocketPath, "goodbye", recording_goodbye)
    with ThreadCluster(2, _options(tmp_path, shm_lane_bytes=1 << 20)) as cluster:
        _allreduce_on(cluster, lambda r: np.full(1000, r, np.float32))
        leaver = cluster.communicators[1]
        assert leaver.p2p.shared_memory_peers == [0]
        leaver.close(timeout=5.0)
    assert released_at_goodbye and all(released_at_goodbye), released_at_goodbye


# ---- a shared-memory directory without room ----------------------------------------------------


def _fallocate_without_room_past(limit, calls):
    """``os.posix_fallocate`` that records its calls and fails with ENOSPC past byte ``limit`` of a file."""
    real = os.posix_fallocate

    def posix_fallocate(fd, offset, length):
        calls.append((offset, length))
        if offset + length > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    return posix_fallocate


@pytest.mark.parametrize("transport", ["data-socket", "grpc"])
def test_payloads_take_the_stream_when_the_directory_has_no_room_for_the_slots(tmp_path, monkeypatch, transport):
    calls = []
    monkeypatch.setattr(os, "posix_fallocate", _fallocate_without_room_past(mmap.PAGESIZE, calls))
    data = np.arange(3_000_001, dtype=np.float32)  # halves of 6 MiB: through the slots, were there room
    options = _options(tmp_path, data_socket=transport == "data-socket")
    with ThreadCluster(2, options, hosts=["host-0", "host-1"]) as cluster:
        for _ in range(2):  # the second after the slots were refused for good
            for result in cluster.run(lambda c: c.allreduce(data * (c.rank + 1))):
                np.testing.assert_array_equal(result, data * 3)
        for c in cluster.communicators:
            assert c.p2p.shared_memory_peers == [1 - c.rank]  # the arena was mapped ...
            assert c.p2p.shared_bytes_sent == 0 and c.p2p.bytes_sent > 0  # ... and its slots never written
    slot_calls = [call for call in calls if call[0] > 0]
    assert len(slot_calls) == 2, calls  # one try per arena, not one per message


def test_a_lane_writes_only_where_its_memory_was_taken_and_refuses_messages_beyond_room(tmp_path, monkeypatch):
    from tests.transport.test_lanes import read_all

    lane_bytes, room = 1 << 20, 64 << 10
    calls = []
    monkeypatch.setattr(os, "posix_fallocate", _fallocate_without_room_past(mmap.PAGESIZE + room, calls))
    sender = SendArena(str(tmp_path), 2, SLOT, lane_bytes=lane_bytes)
    receiver, refusal = ReceiveArena.open(str(tmp_path), sender.offer())
    assert receiver is not None, refusal
    ring = np.frombuffer(sender._map, np.uint8, lane_bytes, mmap.PAGESIZE)
    ring[:] = 0xAB  # untouched bytes keep it
    small = [bytes([i]) * 3000 for i in range(5)]
    for payload in small:  # 15 KiB: the memory taken as the messages reach further
        assert sender.lane.try_send(b"small", memoryview(payload))
    taken = max(offset + length for offset, length in calls) - mmap.PAGESIZE
    assert 15_000 < taken < room and len(calls) == 1 + 5  # the first page, then each message's own bytes
    assert not sender.lane.try_send(b"large", memoryview(bytes(100 << 10)))  # past the room: refused whole
    assert np.all(ring[taken:] == 0xAB)  # nothing written where no memory was taken
    assert read_all(receiver.lane) == [(b"small", p) for p in small]
    calls.clear()
    assert sender.lane.try_send(b"again", memoryview(small[0]))  # the ring starts over in the memory it has
    assert read_all(receiver.lane) == [(b"again", small[0])] and calls == []
    receiver.close()


def _can_mount_a_small_tmpfs(directory) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {directory}"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def test_a_full_shared_memory_directory_slows_payloads_down_and_kills_nothing(tmp_path):
    """For real: an 8 MiB tmpfs (in a mount namespace of the test's own) for 2 arenas of 48 MiB."""
    directory = tmp_path / "shm"
    directory.mkdir()
    if not _can_mount_a_small_tmpfs(directory):
        pytest.skip("needs unshare and tmpfs mounts in a user namespace")
    worker = f"{sys.executable} -m tests.workers.full_shm_dir {directory}"
    script = f"mount -t tmpfs -o size=8m tmpfs {directory} && exec {worker}"
    command = ["unshare", "-rm", "sh", "-c", script]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode} (-7, 135: SIGBUS)\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "sums ok" in done.stdout, done.stdout


def test_an_arena_whose_name_cannot_be_removed_is_still_used(tmp_path, monkeypatch):
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if os.path.basename(path).startswith(NAME_PREFIX):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    data = np.arange(3_000_001, dtype=np.float32)
    start = time.monotonic()
    with ThreadCluster(2, _options(tmp_path), hosts=["host-0", "host-1"]) as cluster:
        for result in cluster.run(lambda c: c.allreduce(data * (c.rank + 1))):
            np.testing.assert_array_equal(result, data * 3)
        for c in cluster.communicators:  # through the slots, not over the stream after a 10 s wait
            assert c.p2p.shared_memory_peers == [1 - c.rank] and c.p2p.shared_bytes_sent > 0
    assert time.monotonic() - start < 8
    assert len(_arenas_left(tmp_path)) == 2  # left for removal by age
