"""The replica's device: the choice (stubbed device lists), and placement on this CPU-only machine."""

import logging
import sys
import types

import pytest
import tensorflow as tf

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.strategy import devices
from tests.launch import read_reports, run_alone, run_job, worker_script

GPUS = [f"/device:GPU:{i}" for i in range(4)]
HOST_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.mark.parametrize(
    "gpus, local_rank, expected",
    [
        ([], 0, "/device:CPU:0"),
        ([], 3, "/device:CPU:0"),
        (GPUS[:1], 0, "/device:GPU:0"),
        (GPUS[:1], 5, "/device:GPU:0"),  # one GPU visible (CUDA_VISIBLE_DEVICES isolation): that one
        (GPUS, 0, "/device:GPU:0"),
        (GPUS, 3, "/device:GPU:3"),
        (GPUS, 6, "/device:GPU:2"),  # more workers than GPUs: local_rank % len(gpus)
        (GPUS[:2], 1, "/device:GPU:1"),
    ],
)
def test_the_device_is_the_gpu_at_local_rank_modulo_the_visible_gpus_else_the_cpu(gpus, local_rank, expected):
    assert devices.choose_device(gpus, local_rank) == expected


class FakeConfig:
    """``tf.config``'s device calls over ``count`` stubbed GPUs (physical and logical)."""

    def __init__(self, count: int, initialized: bool = False):
        self.visible = [types.SimpleNamespace(name=f"/physical_device:GPU:{i}") for i in range(count)]
        self.initialized = initialized
        self.restricted_to = None

    def get_visible_devices(self, device_type):
        assert device_type == "GPU"
        return list(self.visible)

    def set_visible_devices(self, chosen, device_type):
        assert device_type == "GPU"
        if self.initialized:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.restricted_to = [d.name for d in chosen]
        self.visible = list(chosen)

    def list_logical_devices(self, device_type):
        assert device_type == "GPU"
        return [types.SimpleNamespace(name=f"/device:GPU:{i}") for i in range(len(self.visible))]


@pytest.fixture
def fake_config(monkeypatch):
    def install(count: int, initialized: bool = False) -> FakeConfig:
        fake = FakeConfig(count, initialized)
        for name in ("get_visible_devices", "set_visible_devices", "list_logical_devices"):
            monkeypatch.setattr(tf.config, name, getattr(fake, name))
        monkeypatch.setattr(devices, "_logged", set())
        return fake

    return install


def test_without_a_gpu_the_replica_is_on_the_cpu(fake_config):
    fake = fake_config(0)
    assert devices.replica_device({"EDL_LOCAL_RANK": "1"}) == HOST_CPU
    assert fake.restricted_to is None


def test_one_visible_gpu_is_used_as_it_is(fake_config):
    fake = fake_config(1)
    assert devices.replica_device({"EDL_LOCAL_RANK": "3"}) == "/job:localhost/replica:0/task:0/device:GPU:0"
    assert fake.restricted_to is None


def test_with_several_gpus_the_process_keeps_only_its_own_before_tensorflow_starts(fake_config):
    fake = fake_config(4)
    # Slot 6 of a host with 4 GPUs: physical GPU 2, then the only one, so logical GPU 0.
    assert devices.replica_device({"EDL_LOCAL_RANK": "6"}) == "/job:localhost/replica:0/task:0/device:GPU:0"
    assert fake.restricted_to == ["/physical_device:GPU:2"]


def test_once_tensorflow_started_the_same_gpu_is_chosen_with_a_warning(fake_config, caplog):
    fake = fake_config(4, initialized=True)
    with caplog.at_level(logging.INFO, logger="elasticdl_strategy"):
        assert devices.replica_device({"EDL_LOCAL_RANK": "6"}) == "/job:localhost/replica:0/task:0/device:GPU:2"
    assert fake.restricted_to is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "holds memory on all 4 visible GPUs" in warnings[0]


def test_the_device_is_logged_once_at_info(fake_config, caplog):
    fake_config(2)
    with caplog.at_level(logging.INFO, logger="elasticdl_strategy"):
        devices.replica_device({"EDL_LOCAL_RANK": "1"})
        devices.replica_device({"EDL_LOCAL_RANK": "1"})
    lines = [r.getMessage() for r in caplog.records if r.name == devices.__name__]
    gpu = "/job:localhost/replica:0/task:0/device:GPU:0"
    assert lines == [f"replica device {gpu} (EDL_LOCAL_RANK=1, 2 GPU(s) visible to the process)"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == devices.__name__)


@pytest.mark.parametrize("value", ["-1", "one", "1.5"])
def test_a_bad_local_rank_names_the_variable(fake_config, value):
    fake_config(2)
    with pytest.raises(ConfigError, match="EDL_LOCAL_RANK=.* is not a non-negative integer"):
        devices.replica_device({"EDL_LOCAL_RANK": value})


def test_on_this_cpu_only_machine_everything_stays_on_the_cpu(tmp_path):
    result = run_alone([sys.executable, worker_script("strategy_devices.py"), str(tmp_path), "host"])
    assert result.returncode == 0, result.stderr[-3000:]
    (report,) = read_reports(tmp_path, [0])
    assert report["worker_devices"] == [HOST_CPU]
    assert report["variable_devices"] == [HOST_CPU] and report["optimizer_devices"] == [HOST_CPU]
    assert report["eager_devices"] == [HOST_CPU] * 3
    assert report["weights_moved"]
    logged = [line for line in result.stderr.splitlines() if "replica device" in line]
    assert len(logged) == 1, result.stderr[-3000:]
    assert f" INFO [single worker] elasticdl_strategy.strategy.devices: replica device {HOST_CPU} " in logged[0]


@pytest.mark.slow
def test_a_replica_off_its_host_keeps_variables_there_and_reduces_on_the_host(tmp_path):
    # No GPU here: /device:CPU:1 stands in for one (see the worker script). Its host is CPU:0.
    replica = "/job:localhost/replica:0/task:0/device:CPU:1"
    job = run_job(2, [sys.executable, worker_script("strategy_devices.py"), str(tmp_path), "stand-in"], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    reports = read_reports(tmp_path, [0, 1])
    for rank, report in enumerate(reports):
        assert report["worker_devices"] == [replica]
        assert report["variable_devices"] == [replica] and report["optimizer_devices"] == [replica]
        # The ring's ops run on the host; each result is copied back onto the replica's device once.
        assert report["ring_op_devices"] == [HOST_CPU] and report["ring_op_count"] == 2
        assert report["copy_devices"] == [replica] and report["copy_count"] == 2
        assert report["eager_devices"] == [replica] * 3
        assert report["eager_total"] == [3.0, 3.0] and report["eager_rows"] == [0, 1]
        assert report["graph_total"] == [6.0] * 3 and report["graph_rows"] == [[0.0, 0.0], [1.0, 1.0]]
        assert report["weights_moved"]
    assert reports[0]["weights"] == reports[1]["weights"]  # trained in step through the ring
