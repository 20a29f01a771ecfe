"""Logging: nothing on import, one format with the process's role or worker and rank in a job."""

import subprocess
import sys

from tests.launch import REPO_ROOT, run_job, worker_script

SNIPPET = """
import logging, os
from elasticdl_strategy import logs
{before}
logs.configure(lambda: "worker-3 rank 1/2", os.environ)
logs.configure(lambda: "twice", os.environ)  # changes nothing
logging.getLogger("elasticdl_strategy.x").info("an ordinary event")
logging.getLogger("elasticdl_strategy.x").debug("a detail")
logging.getLogger("other.library").info("not ours")
"""


def _run(code, env=None):
    env = {"PYTHONPATH": REPO_ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_importing_the_package_prints_nothing_even_for_warnings():
    code = "import logging, elasticdl_strategy; logging.getLogger('elasticdl_strategy.x').warning('unseen')"
    assert _run(code).stderr == ""


def test_a_job_process_logs_one_line_per_event_with_who_logged_it():
    lines = _run(SNIPPET.format(before="")).stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(" INFO [worker-3 rank 1/2] elasticdl_strategy.x: an ordinary event")


def test_the_level_comes_from_edl_log_level():
    lines = _run(SNIPPET.format(before=""), {"EDL_LOG_LEVEL": "debug"}).stderr.splitlines()
    assert [line.rsplit(": ", 1)[1] for line in lines] == ["an ordinary event", "a detail"]
    assert _run(SNIPPET.format(before=""), {"EDL_LOG_LEVEL": "WARNING"}).stderr == ""


def test_a_program_that_set_up_logging_keeps_its_handlers_and_format():
    before = "logging.basicConfig(format='mine %(levelname)s %(message)s', level=logging.INFO)"
    lines = _run(SNIPPET.format(before=before)).stderr.splitlines()
    assert lines == ["mine INFO an ordinary event", "mine INFO not ours"]


def test_a_bad_edl_log_level_is_a_one_line_error():
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl_strategy", "run", "--workers", "1", "--", "true"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": REPO_ROOT, "EDL_LOG_LEVEL": "loud", "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "elasticdl-strategy: error: EDL_LOG_LEVEL='loud' must be one of DEBUG, INFO, WARNING, ERROR"
    ]


def test_launched_workers_log_their_worker_id_and_rank():
    job = run_job(2, [sys.executable, worker_script("collective_example.py")], timeout=90)
    assert job.returncode == 0, job.stderr[-2000:]
    joined = [line for line in job.stderr.splitlines() if "joined as rank" in line]
    assert len(joined) == 2, job.stderr[-2000:]
    for line in joined:
        # "[worker 0] 2026-... INFO [worker-0 joining] elasticdl_strategy.runtime.worker: joined as rank 0 of 2 ..."
        assert " INFO [worker-" in line and "elasticdl_strategy.runtime.worker: joined as rank" in line
