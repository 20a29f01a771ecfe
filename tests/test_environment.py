"""The worker environment: parsing, validation, TF_CONFIG interop."""

import json

import pytest

from elasticdl_strategy.environment import WorkerEnvironment
from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.transport.auth import new_token

BASE = {"EDL_COORDINATOR_ADDR": "master:50051", "EDL_JOB_TOKEN": new_token()}


def test_without_a_coordinator_there_is_no_job():
    assert WorkerEnvironment.from_env({}) is None


def test_worker_id_comes_from_tf_config_when_an_operator_set_it():
    tf_config = {"cluster": {"worker": ["a:1", "b:1", "c:1"]}, "task": {"type": "worker", "index": 2}}
    env = WorkerEnvironment.from_env({**BASE, "TF_CONFIG": json.dumps(tf_config)})
    assert env.worker_id == "worker-2" and env.coordinator_address == "master:50051"
    # An explicit worker id wins.
    assert (
        WorkerEnvironment.from_env({**BASE, "TF_CONFIG": json.dumps(tf_config), "EDL_WORKER_ID": "w"}).worker_id == "w"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, "EDL_WORKER_ID"),
        ({"TF_CONFIG": "{not json"}, "TF_CONFIG has no task"),
        ({"EDL_WORKER_ID": "w", "EDL_PEER_PORT": "http"}, "EDL_PEER_PORT='http'"),
        ({"EDL_WORKER_ID": "w", "EDL_PEER_PORT": "70000"}, "EDL_PEER_PORT=70000"),
        ({"EDL_WORKER_ID": "w", "EDL_DATA_PORT": "-1"}, "EDL_DATA_PORT=-1"),
        ({"EDL_WORKER_ID": "w", "EDL_RENDEZVOUS_TIMEOUT": "-1"}, "EDL_RENDEZVOUS_TIMEOUT=-1"),
    ],
)
def test_bad_environments_name_the_variable(extra, message):
    with pytest.raises(ConfigError, match=message):
        WorkerEnvironment.from_env({**BASE, **extra})


def test_the_host_id_is_read_and_empty_by_default():
    assert WorkerEnvironment.from_env({**BASE, "EDL_WORKER_ID": "w", "EDL_HOST_ID": "node-3"}).host_id == "node-3"
    assert WorkerEnvironment.from_env({**BASE, "EDL_WORKER_ID": "w"}).host_id == ""


def test_peer_and_data_ports_are_read():
    env = WorkerEnvironment.from_env({**BASE, "EDL_WORKER_ID": "w", "EDL_PEER_PORT": "50052", "EDL_DATA_PORT": "50053"})
    assert (env.peer_port, env.data_port) == (50052, 50053)
