"""The collectives in separate processes started by the real launcher, N = 1..4."""

import json
import sys

import pytest

from elasticdl_strategy.collective import cost_model
from tests.launch import run_job, transport_env, worker_script
from tests.memory_holder import cross_memory_allowed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "n, transport",
    [(1, "host-segment"), (2, "shared-memory"), (2, "data-socket"), (3, "grpc"), (4, "host-segment")],
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
        assert report["paths"]["shared_memory"] == (others if transport in ("host-segment", "shared-memory") else [])
        assert report["paths"]["data_socket"] == (others if transport != "grpc" else [])
    # Processes of one user on one host read each other's arrays where they lie, unless the kernel forbids it.
    single_copy = {report["paths"]["single_copy"] for report in reports}
    assert single_copy == {transport == "host-segment" and n > 1 and cross_memory_allowed()}

    divisible, uneven, small = ([r["counters"][i] for r in reports] for i in range(3))
    if n == 1:
        return
    # Each rank moves what the algorithm the cost model picks for the size says: the ring 2(N-1)/N
    # of the data (the ranks together exactly 2(N-1) times it, whatever the size), the direct
    # exchange N-1 arrays, recursive doubling log2(N) arrays (one more for the fold).
    for case in (divisible, uneven, small):
        nbytes = case[0]["nbytes"]
        in_slots = nbytes <= int(transport_env(transport)["EDL_HOST_SEGMENT_BYTES"])
        if transport == "host-segment" and (in_slots or True in single_copy):
            assert all(c["sent"] == c["received"] == 0 for c in case), case  # no message: all in the segment
            continue
        algorithm = cost_model.choose(nbytes, n)
        if algorithm == "ring":
            assert sum(c["sent"] for c in case) == sum(c["received"] for c in case) == 2 * (n - 1) * nbytes
            if (nbytes // 4) % n == 0:  # float32: segments of equal elements
                assert all(c["sent"] == c["received"] == 2 * (n - 1) * nbytes // n for c in case)
            continue
        for rank, c in enumerate(case):
            arrays = n - 1 if algorithm == "direct" else _recursive_doubling_arrays(rank, n)
            assert c["sent"] == c["received"] == arrays * nbytes, (algorithm, nbytes, rank)
    assert cost_model.choose(small[0]["nbytes"], n) != "ring"  # a small array takes one round or log2(N)


def _recursive_doubling_arrays(rank: int, n: int) -> int:
    """Whole arrays one rank sends (and receives) in a recursive-doubling all-reduce."""
    core = 1 << (n.bit_length() - 1)
    if rank >= core:
        return 1
    return core.bit_length() - 1 + (1 if rank + core < n else 0)
