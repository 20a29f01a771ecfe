"""The collectives in separate processes started by the real launcher, N = 1..4."""

import json
import sys

import pytest

from tests.launch import run_job, transport_env, worker_script

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "n, transport",
    [(1, "shared-memory"), (2, "shared-memory"), (2, "data-socket"), (3, "grpc"), (4, "shared-memory")],
)
def test_every_collective_dtype_and_edge_size_in_processes(tmp_path, n, transport):
    extra_flags = ["--64mib"] if n in (2, 4) else []
    env = transport_env(transport)
    command = [sys.executable, worker_script("collectives_matrix.py"), str(tmp_path), *extra_flags]
    job = run_job(n, command, timeout=240, env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    assert sorted(r["rank"] for r in reports) == list(range(n))
    for report in reports:
        assert report["size"] == n
        assert report["failures"] == [], report["failures"][:5]
        others = [r for r in range(n) if r != report["rank"]]
        assert report["paths"]["shared_memory"] == (others if transport == "shared-memory" else [])
        assert report["paths"]["data_socket"] == (others if transport != "grpc" else [])

    divisible, uneven, small = ([r["counters"][i] for r in reports] for i in range(3))
    # Divisible size: every rank sends and receives exactly 2(N-1)/N of the data.
    for c in divisible:
        assert c["sent"] == c["received"] == 2 * (n - 1) * c["nbytes"] // n
    # Any size: the ranks together move exactly 2(N-1) times the data.
    assert sum(c["sent"] for c in uneven) == 2 * (n - 1) * uneven[0]["nbytes"]
    assert sum(c["received"] for c in uneven) == 2 * (n - 1) * uneven[0]["nbytes"]
    # A small array goes straight to every peer: one message latency instead of 2(N-1).
    for c in small:
        assert c["sent"] == c["received"] == (n - 1) * c["nbytes"]
