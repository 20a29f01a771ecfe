"""The local launcher's GPUs: where it learns them, how it splits them between worker slots."""

import os

import pytest

from elasticdl_strategy.errors import ConfigError
from elasticdl_strategy.launcher import gpus
from elasticdl_strategy.launcher.gpus import GpuPool

LISTING = "GPU 0: NVIDIA H100 (UUID: GPU-a)\n  MIG 1g.10gb Device 0: (UUID: MIG-x)\nGPU 1: NVIDIA H100 (UUID: GPU-b)\n"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0,1,2", ["0", "1", "2"]),
        (" 3 , 1", ["3", "1"]),
        ("GPU-8e1c,GPU-77aa", ["GPU-8e1c", "GPU-77aa"]),
        ("", []),
        ("-1", []),
        ("2,-1,3", ["2"]),  # CUDA stops at the first invalid entry
        ("1,,2", ["1"]),
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(text, expected):
    assert gpus.parse_visible_devices(text) == expected


def test_the_launchers_cuda_visible_devices_comes_before_nvidia_smi():
    def never():
        raise AssertionError("nvidia-smi must not be asked")

    pool = GpuPool.discover({"CUDA_VISIBLE_DEVICES": "4,5"}, nvidia_smi=never)
    assert pool == GpuPool(("4", "5"), "CUDA_VISIBLE_DEVICES='4,5'")
    assert GpuPool.discover({}, nvidia_smi=lambda: LISTING) == GpuPool(("0", "1"), "nvidia-smi -L")
    assert GpuPool.discover({}, nvidia_smi=lambda: "").gpus == ()
    assert GpuPool.discover({}, nvidia_smi=lambda: None).gpus is None


def test_slot_i_gets_gpus_i_times_g_to_i_plus_one_times_g():
    pool = GpuPool(("0", "1", "2", "3", "4", "5"), "test")
    assert [pool.for_slot(slot, 2) for slot in range(3)] == ["0,1", "2,3", "4,5"]
    assert [pool.for_slot(slot, 1) for slot in range(3)] == ["0", "1", "2"]
    assert GpuPool(("GPU-a", "GPU-b"), "test").for_slot(1, 1) == "GPU-b"
    assert GpuPool(None, "unknown").for_slot(3, 2) == "6,7"


def test_too_few_gpus_are_refused_unless_the_count_is_unknown():
    pool = GpuPool(("0", "1", "2"), "nvidia-smi -L")
    pool.check(slots=3, per_worker=1)
    with pytest.raises(ConfigError, match=r"^--gpus-per-worker=2 needs 4 GPUs for 2 workers, but this machine has 3"):
        pool.check(slots=2, per_worker=2)
    GpuPool(None, "unknown").check(slots=64, per_worker=8)


@pytest.mark.parametrize(
    "script, expected",
    [
        (f"printf '{LISTING}'", LISTING),
        ("echo 'No devices were found'; exit 6", ""),
        ("echo 'Failed to initialize NVML: Driver/library version mismatch'; exit 18", None),
    ],
)
def test_nvidia_smi_answers_a_listing_no_devices_or_nothing(tmp_path, monkeypatch, script, expected):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpus.list_with_nvidia_smi() == expected


def test_without_nvidia_smi_there_is_no_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpus.list_with_nvidia_smi() is None
