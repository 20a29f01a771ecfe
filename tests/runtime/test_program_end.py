"""How a worker's program ends tells the job whether it finished (runtime's leave at exit).

Scripts call ``runtime.init()`` and never ``shutdown()``: the runtime leaves the job when the
main thread ends, as finished unless the program ended with an uncaught exception.
"""

import sys

import pytest

from tests.launch import run_job, worker_script

pytestmark = pytest.mark.slow


def _run(tmp_path, workers, mode, flags):
    command = [sys.executable, worker_script("program_end.py"), str(tmp_path), mode]
    return run_job(workers, command, flags, timeout=120)


def test_members_that_end_normally_finish_the_job_and_the_standby_leaves_with_code_0(tmp_path):
    job = _run(tmp_path, 3, "finish", ["--max-workers", "2"])
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-3000:]
    assert output.count(": done") == 2, output[-3000:]
    assert output.count("the job finished; no membership will come: this standby leaves") == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_a_member_that_crashes_does_not_finish_the_job_so_the_standby_takes_its_place(tmp_path):
    # One place: the first member crashes; were its end taken for the job's, the standby would leave.
    job = _run(tmp_path, 2, "crash_first", ["--max-workers", "1", "--min-workers", "1", "--max-restarts", "0"])
    output = job.stdout + job.stderr
    assert "crashing on purpose" in output, output[-3000:]
    assert output.count(": done") == 1, output[-3000:]
    assert "this standby leaves" not in output, output[-3000:]
