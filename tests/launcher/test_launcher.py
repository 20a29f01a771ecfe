"""``elasticdl-strategy run``: argument errors, output prefixes, failures, signals."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.launch import REPO_ROOT, Job, launcher_argv, run_job, worker_script


def cli(*args, timeout=30):
    return subprocess.run(
        [sys.executable, "-m", "elasticdl_strategy", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--workers", "0", "--", "true"], "--workers=0"),
        (["run", "--workers", "2", "--min-workers", "3", "--", "true"], "--min-workers=3"),
        (["run", "--workers", "3", "--min-workers", "2", "--max-workers", "1", "--", "true"], "--max-workers=1"),
        (["run", "--workers", "2", "--max-restarts", "-1", "--", "true"], "--max-restarts=-1"),
        (["run", "--workers", "2", "--bogus", "--", "true"], "unrecognized arguments: --bogus"),
        (["run", "--workers", "2"], "missing command"),
        (["run", "--workers", "2", "--", "no-such-command-xyz"], "command not found"),
        (["run", "--workers", "two", "--", "true"], "invalid int value"),
        (["run", "--workers", "2", "--gpus-per-worker", "-1", "--", "true"], "--gpus-per-worker=-1 must not be"),
        (["run", "--workers", "2", "--gpus-per-worker", "one", "--", "true"], "invalid int value: 'one'"),
        (["frobnicate"], "unknown command"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_before_starting_anything(args, message):
    start = time.monotonic()
    result = cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "[coordinator]" not in result.stdout + result.stderr
    assert time.monotonic() - start < 15


def test_port_in_use_is_refused_before_starting_anything():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = cli("run", "--workers", "1", "--port", str(port), "--", "true")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"--port={port}" in result.stderr


def test_output_is_prefixed_and_success_exits_0(tmp_path):
    job = run_job(2, [sys.executable, worker_script("plain.py"), "hello", str(tmp_path)], timeout=60)
    assert job.returncode == 0, job.stderr
    assert "[worker 0] hello from worker-0" in job.stdout
    assert "[worker 1] hello from worker-1" in job.stdout


@pytest.mark.slow
def test_each_worker_gets_its_share_of_the_cores_unless_the_user_chose(tmp_path):
    share = max(1, os.cpu_count() // 2)
    job = run_job(2, [sys.executable, worker_script("plain.py"), "hello", str(tmp_path)], timeout=60)
    assert job.returncode == 0, job.stderr[-2000:]
    assert job.stdout.count(f"threads {share} {share}") == 2
    chosen = {"TF_NUM_INTRAOP_THREADS": "7", "OMP_NUM_THREADS": "5"}
    job = run_job(2, [sys.executable, worker_script("plain.py"), "hello", str(tmp_path)], timeout=60, env=chosen)
    assert job.returncode == 0, job.stderr[-2000:]
    assert job.stdout.count("threads 7 5") == 2


def _devices_of(stdout: str) -> dict:
    """``{worker id: (slot, CUDA_VISIBLE_DEVICES)}`` from the lines of plain.py's ``devices`` mode."""
    found = {}
    for line in stdout.splitlines():
        if "devices of " in line:
            worker, rest = line.split("devices of ", 1)[1].split(": ", 1)
            _, slot, _, cuda = rest.split(" ")
            found[worker] = (slot, cuda)
    return found


def _fake_nvidia_smi(directory, gpus: int, fails: bool = False) -> str:
    """A directory holding an ``nvidia-smi`` that lists ``gpus`` GPUs (or fails as without a driver)."""
    script = directory / "nvidia-smi"
    listing = "".join(f"GPU {i}: NVIDIA Fake (UUID: GPU-{i:04d})\\n" for i in range(gpus))
    body = 'echo "NVIDIA-SMI has failed" >&2; exit 9' if fails else f'printf "{listing}"'
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return f"{directory}{os.pathsep}{os.environ['PATH']}"


def test_without_gpus_per_worker_cuda_visible_devices_is_left_alone_and_slots_are_set(tmp_path):
    command = [sys.executable, worker_script("plain.py"), "devices", str(tmp_path)]
    job = run_job(2, command, env={"CUDA_VISIBLE_DEVICES": "5,6"}, timeout=60)
    assert job.returncode == 0, job.stderr
    assert _devices_of(job.stdout) == {"worker-0": ("0/2", "5,6"), "worker-1": ("1/2", "5,6")}
    assert "CUDA_VISIBLE_DEVICES per worker slot" not in job.stderr


def test_each_slot_gets_its_gpus_standbys_theirs_and_a_replacement_those_of_the_worker_it_replaces(tmp_path):
    # 3 slots of 2 GPUs out of the launcher's CUDA_VISIBLE_DEVICES; slot 2 is a standby (--max-workers 2).
    # worker-1 exits 3: worker-3 replaces it in slot 1, on the GPUs worker-1 had.
    command = [sys.executable, worker_script("plain.py"), "devices", str(tmp_path), "1"]
    flags = ["--gpus-per-worker", "2", "--max-workers", "2", "--max-restarts", "1"]
    job = run_job(3, command, extra=flags, env={"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7,8"}, timeout=60)
    assert job.returncode == 0, job.stderr
    assert _devices_of(job.stdout) == {
        "worker-0": ("0/3", "2,3"),
        "worker-1": ("1/3", "4,5"),
        "worker-2": ("2/3", "6,7"),
        "worker-3": ("1/3", "4,5"),
    }
    assert "worker 1 exited with code 3; started worker 3 in its place" in job.stderr
    assert "CUDA_VISIBLE_DEVICES per worker slot: slot 0: 2,3; slot 1: 4,5; slot 2: 6,7" in job.stderr


def test_without_cuda_visible_devices_the_gpus_are_those_nvidia_smi_lists(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, gpus=2))
    command = [sys.executable, worker_script("plain.py"), "devices", str(tmp_path)]
    job = run_job(2, command, extra=["--gpus-per-worker", "1"], timeout=60)
    assert job.returncode == 0, job.stderr
    assert _devices_of(job.stdout) == {"worker-0": ("0/2", "0"), "worker-1": ("1/2", "1")}


@pytest.mark.parametrize(
    "cuda_visible_devices, gpus, message",
    [
        (None, 2, "needs 3 GPUs for 3 workers, but this machine has 2 (nvidia-smi -L)"),
        ("0,1", 8, "needs 3 GPUs for 3 workers, but this machine has 2 (CUDA_VISIBLE_DEVICES='0,1')"),
        ("", 8, "needs 3 GPUs for 3 workers, but this machine has 0 (CUDA_VISIBLE_DEVICES='')"),
    ],
)
def test_too_few_gpus_is_a_one_line_error_before_anything_starts(tmp_path, cuda_visible_devices, gpus, message):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=_fake_nvidia_smi(tmp_path, gpus), PYTHONPATH=REPO_ROOT)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    argv = [sys.executable, "-m", "elasticdl_strategy", "run", "--workers", "3", "--gpus-per-worker", "1", "--", "true"]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--gpus-per-worker=1 {message}" in lines[0], result.stderr
    assert "[coordinator]" not in result.stdout + result.stderr


def test_when_the_gpus_cannot_be_counted_indices_are_handed_out_and_it_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, gpus=0, fails=True))
    command = [sys.executable, worker_script("plain.py"), "devices", str(tmp_path)]
    job = run_job(2, command, extra=["--gpus-per-worker", "1"], timeout=60)
    assert job.returncode == 0, job.stderr
    assert _devices_of(job.stdout) == {"worker-0": ("0/2", "0"), "worker-1": ("1/2", "1")}
    assert "per worker slot (unchecked: CUDA_VISIBLE_DEVICES unset and no answer from nvidia-smi -L)" in job.stderr


def test_workers_join_through_collective_init(tmp_path):
    job = run_job(3, [sys.executable, worker_script("collective_example.py")], timeout=90)
    assert job.returncode == 0, job.stderr[-2000:]
    for rank in range(3):
        assert f"rank {rank} of 3 total 3" in job.stdout


def test_failing_worker_is_reported_with_exit_code_and_stderr_tail(tmp_path):
    job = run_job(2, [sys.executable, worker_script("plain.py"), "fail-one", str(tmp_path)], timeout=60)
    assert job.returncode == 1
    assert "worker 1 exited with code 3" in job.stderr
    assert "something went wrong: boom" in job.stderr.split("worker 1 exited with code 3", 1)[1]


def test_every_failed_worker_is_reported_with_how_it_ended(tmp_path):
    job = run_job(2, [sys.executable, worker_script("plain.py"), "fail-each-way", str(tmp_path)], timeout=60)
    assert job.returncode == 1
    # Which of the two the launcher saw end first is a race; both are described either way.
    assert "worker 0 exited with code 3" in job.stderr or "worker 0 (exited with code 3)" in job.stderr
    assert "worker 1 was killed by signal 9" in job.stderr or "worker 1 (was killed by signal 9)" in job.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_every_worker(tmp_path, sig):
    job = Job(launcher_argv(2, [sys.executable, worker_script("plain.py"), "wait-for-signal", str(tmp_path)]))
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline, "workers did not start"
            assert job.proc.poll() is None, job.proc.communicate()
            time.sleep(0.05)
        job.proc.send_signal(sig)
        job.proc.wait(timeout=30)
        assert job.proc.returncode == 128 + sig
        assert all((tmp_path / f"term{i}").exists() for i in range(2))
    finally:
        job.kill()


@pytest.mark.slow
def test_collective_api_example_trains_on_two_workers():
    example = os.path.join(REPO_ROOT, "examples", "train_linear_numpy.py")
    job = run_job(2, [sys.executable, example, "--steps", "120"], timeout=90)
    assert job.returncode == 0, job.stderr[-2000:]
    assert job.stdout.count("weights identical on all ranks: True") == 2


@pytest.mark.slow
@pytest.mark.parametrize("example, expected", [("keras_fit.py", "test loss"), ("custom_loop.py", "test accuracy")])
def test_strategy_examples_reach_their_target_accuracy_on_two_workers(example, expected):
    # The README's main job runs keras_fit.py; both exit non-zero below their target accuracy.
    path = os.path.join(REPO_ROOT, "examples", example)
    job = run_job(2, [sys.executable, path, "--epochs", "3", "--samples", "4096"], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert f"2 workers: {expected}" in job.stdout
    if example == "keras_fit.py":  # Keras progress: printed by one worker (rank 0) only
        printers = {line.split("]")[0] for line in job.stdout.splitlines() if "Epoch 1/3" in line}
        assert len(printers) == 1, job.stdout


@pytest.mark.slow
def test_elastic_example_survives_a_kill_with_identical_replicas(tmp_path):
    # 4 workers for 3 places: one waits as a standby. A member killed in the second epoch is
    # replaced by the standby at once; its reset callback scales the learning rate like everyone's.
    path = os.path.join(REPO_ROOT, "examples", "elastic_keras.py")
    command = [sys.executable, path, "--epochs", "4", "--samples", "4096", "--checkpoint-dir", str(tmp_path / "ckpt")]
    flags = ["--min-workers", "2", "--max-workers", "3", "--heartbeat-timeout", "3"]
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        job = Job(launcher_argv(4, command, flags), output=log)
        try:
            victim = _member_pid_once_training(job, log_path, rank=1, deadline=time.monotonic() + 120)
            os.kill(victim, signal.SIGKILL)
            code = job.proc.wait(timeout=240)
        finally:
            job.kill()
    output = log_path.read_text()
    assert code == 0, output[-3000:]
    assert "3 workers at the end: test loss" in output, output[-3000:]
    assert "replicas identical (weights and optimizer state)" in output
    assert "ran out of data" not in output  # epochs of any length are expected, not warned about
    assert (tmp_path / "ckpt" / "latest").exists()


def _member_pid_once_training(job, log_path, rank, deadline):
    """The pid of the first membership's ``rank``, once the job prints its second epoch."""
    while time.monotonic() < deadline and job.proc.poll() is None:
        lines = log_path.read_text().splitlines()
        formed = [line for line in lines if "membership version 0 -> 1 (formed)" in line]
        if formed and any("Epoch 2/" in line for line in lines):
            worker_id = formed[0].rsplit("-> [", 1)[1].strip("]").replace("'", "").split(", ")[rank]
            for pid in job.pids():
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"EDL_WORKER_ID={worker_id}".encode() in f.read().split(b"\0"):
                        return pid
        time.sleep(0.1)  # polling the job's output
    raise AssertionError("the job did not reach its second epoch:\n" + log_path.read_text()[-3000:])


@pytest.mark.slow
def test_tls_flags_secure_the_coordinator_and_the_ring(tls_files):
    tls = ["--tls-cert", tls_files.cert_file, "--tls-key", tls_files.key_file, "--tls-ca", tls_files.ca_file]
    job = run_job(2, [sys.executable, worker_script("collective_example.py")], extra=tls, timeout=90)
    assert job.returncode == 0, job.stderr[-2000:]
    assert "rank 0 of 2 total 2" in job.stdout and "rank 1 of 2 total 2" in job.stdout


def test_script_without_the_launcher_runs_as_a_single_worker_and_says_so_once():
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDL_")}
    env["PYTHONPATH"] = REPO_ROOT
    result = subprocess.run(
        [sys.executable, worker_script("collective_example.py")], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 1 total 1" in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "single worker, rank 0 of 1" in lines[0], result.stderr
