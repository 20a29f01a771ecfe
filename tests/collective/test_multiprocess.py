"""The collectives in separate processes started by the real launcher, N = 1..4."""

import json
import sys

import pytest

from elasticdl_strategy.collective import cost_model
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
    if n == 1:
        return
    # Large arrays go around the ring. Divisible size: every rank sends and receives exactly 2(N-1)/N
    # of the data; any size: the ranks together move exactly 2(N-1) times the data.
    assert cost_model.choose(divisible[0]["nbytes"], n) == cost_model.choose(uneven[0]["nbytes"], n) == "ring"
    for c in divisible:
        assert c["sent"] == c["received"] == 2 * (n - 1) * c["nbytes"] // n
    assert sum(c["sent"] for c in uneven) == 2 * (n - 1) * uneven[0]["nbytes"]
    assert sum(c["received"] for c in uneven) == 2 * (n - 1) * uneven[0]["nbytes"]
    # A small array takes one message latency: straight to every peer (N-1 arrays out and in), or
    # log2(N) exchanges of the whole array when the ranks are many.
    algorithm = cost_model.choose(small[0]["nbytes"], n)
    for rank, c in enumerate(small):
        arrays = n - 1 if algorithm == "direct" else _recursive_doubling_arrays(rank, n)
        assert c["sent"] == c["received"] == arrays * c["nbytes"], (algorithm, rank)


def _recursive_doubling_arrays(rank: int, n: int) -> int:
    """Whole arrays one rank sends (and receives) in a recursive-doubling all-reduce."""
    core = 1 << (n.bit_length() - 1)
    if rank >= core:
        return 1
    return core.bit_length() - 1 + (1 if rank + core < n else 0)
