import os

import pytest

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.options import OVERSUBSCRIBED_SPIN_US, MiB, TransportOptions


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk_size": 1000}, "chunk_size=1000"),
        ({"chunk_size": 128 * MiB}, "chunk_size="),
        ({"inline_threshold": 8 * MiB}, "inline_threshold="),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"keepalive_s": -1}, "keepalive_s=-1"),
        ({"shm_lane_bytes": 1000}, "shm_lane_bytes=1000"),
        ({"spin_us": -1}, "spin_us=-1"),
        ({"host_segment_bytes": 1000}, "host_segment_bytes=1000"),
    ],
)
def test_invalid_options_name_the_bad_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TransportOptions(**kwargs)


def test_message_limits_are_explicit_and_above_the_chunk_size():
    options = dict(TransportOptions(chunk_size=2 * MiB).grpc_options())
    assert options["grpc.max_send_message_length"] > 2 * MiB
    assert options["grpc.max_receive_message_length"] > 2 * MiB


def test_from_env_parses_and_rejects():
    assert TransportOptions.from_env({"EDL_CHUNK_SIZE": str(MiB), "EDL_TIMEOUT": "5"}).timeout_s == 5.0
    with pytest.raises(ConfigError, match="EDL_TIMEOUT='soon'"):
        TransportOptions.from_env({"EDL_TIMEOUT": "soon"})


def test_the_host_segments_size_is_the_default_unless_set():
    assert TransportOptions.from_env({}).host_segment_bytes is None  # see host_allreduce.slot_sizes
    assert TransportOptions.from_env({"EDL_HOST_SEGMENT_BYTES": "0"}).host_segment_bytes == 0
    assert TransportOptions.from_env({"EDL_HOST_SEGMENT_BYTES": "8192"}).host_segment_bytes == 8192


def test_single_copy_is_on_unless_turned_off():
    assert TransportOptions.from_env({}).single_copy
    assert not TransportOptions.from_env({"EDL_SINGLE_COPY": "0"}).single_copy
    with pytest.raises(ConfigError, match="EDL_SINGLE_COPY='off' must be 0 or 1"):
        TransportOptions.from_env({"EDL_SINGLE_COPY": "off"})


def test_callers_spin_yielding_their_core_only_where_the_hosts_workers_outnumber_its_cores():
    cores = len(os.sched_getaffinity(0))
    alone = TransportOptions.from_env({"EDL_LOCAL_SIZE": str(cores)})
    assert (alone.spin_us, alone.spin_yield) == (200.0, False)
    crowded = TransportOptions.from_env({"EDL_LOCAL_SIZE": str(cores + 1)})
    assert (crowded.spin_us, crowded.spin_yield) == (OVERSUBSCRIBED_SPIN_US, True)
    told = TransportOptions.from_env({"EDL_LOCAL_SIZE": str(cores + 1), "EDL_SPIN_US": "50", "EDL_SPIN_YIELD": "0"})
    assert (told.spin_us, told.spin_yield) == (50.0, False)
    no_yield = TransportOptions.from_env({"EDL_LOCAL_SIZE": str(cores + 1), "EDL_SPIN_YIELD": "0"})
    assert (no_yield.spin_us, no_yield.spin_yield) == (0.0, False)  # sleeps at once, as a spin would hold the core
    with pytest.raises(ConfigError, match="EDL_SPIN_YIELD='yes' must be 0 or 1"):
        TransportOptions.from_env({"EDL_SPIN_YIELD": "yes"})
    assert TransportOptions.from_env({"EDL_SHM_LANE_BYTES": "0"}).shm_lane_bytes == 0
