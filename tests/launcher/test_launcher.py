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
