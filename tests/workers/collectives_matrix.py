"""Worker of test_multiprocess.py: every collective, every dtype, edge sizes and 64 MiB.

Writes ``{results_dir}/rank{r}.json`` with a list of failures (empty when all
checks pass) and the byte counters of the all-reduce checks.
"""

import sys

import numpy as np

from elasticdl_strategy import runtime
from tests.collective.reference import assert_close, assert_identical, make_input, reduce_reference
from tests.workers.report import write_report

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "bool"]
OPS = {
    "bool": ["min", "max"],
    "int32": ["sum", "prod", "min", "max"],
    "int64": ["sum", "prod", "min", "max"],
    "uint8": ["sum", "max"],
}


def main(results_dir: str, with_64mib: bool) -> None:
    runtime.init()
    rank, n = runtime.rank(), runtime.size()
    failures, counters = [], []

    def check(name, fn):
        try:
            fn()
        except Exception as e:  # recorded, not raised: report every failing case
            failures.append(f"{name}: {type(e).__name__}: {e}")

    sizes = [(0,), (1,), (n + 1,), (2 * n + 3, 5), (3, 4, 5)]
    for dtype in DTYPES:
        for shape in sizes:
            for op in OPS.get(dtype, ["sum", "mean", "prod", "min", "max"]):

                def allreduce_case(shape=shape, dtype=dtype, op=op):
                    inputs = [make_input(11, r, shape, dtype, op) for r in range(n)]
                    result = runtime.allreduce(inputs[rank], op=op)
                    assert_close(result, reduce_reference(inputs, op))
                    # bitwise identical on every rank
                    assert_identical([runtime.broadcast(result, root=r) for r in range(n)] + [result])

                check(f"allreduce {dtype} {shape} {op}", allreduce_case)

            def others(shape=shape, dtype=dtype):
                inputs = [make_input(5, r, shape, dtype) for r in range(n)]
                got = runtime.broadcast(inputs[rank], root=n - 1)
                assert got.tobytes() == inputs[n - 1].tobytes()
                if len(shape) >= 1:
                    rows = [make_input(7, r, (r % 3,) + shape[1:], dtype) for r in range(n)]
                    np.testing.assert_array_equal(runtime.allgather(rows[rank]), np.concatenate(rows))
                    gathered = runtime.gather(rows[rank], root=0)
                    if rank == 0:
                        np.testing.assert_array_equal(gathered, np.concatenate(rows))
                    else:
                        assert gathered is None
                op = "max" if dtype == "bool" else "sum"
                if len(shape) >= 1:
                    part = runtime.reduce_scatter(inputs[rank], op=op)
                    assert_close(part, np.array_split(reduce_reference(inputs, op), n)[rank])
                reduced = runtime.reduce(inputs[rank], root=n - 1, op=op)
                if rank == n - 1:
                    assert_close(reduced, reduce_reference(inputs, op))
                parts = [make_input(9, i, shape, dtype) for i in range(n)]
                mine = runtime.scatter(parts if rank == 0 else None, root=0)
                assert mine.tobytes() == parts[rank].tobytes()
                runtime.barrier()

            check(f"others {dtype} {shape}", others)

    # Byte counters: a ring all-reduce of S bytes sends and receives 2(N-1)/N * S per rank
    # (large arrays); a small one (the direct exchange, (N-1) * S <= 1 MiB) (N-1) * S.
    # Barriers around the all-reduce so that no message of a neighbour's next collective is
    # counted; what one barrier moves (N-1 bytes each way, none through a host segment) is taken off.
    runtime.barrier()
    before = runtime.stats()
    runtime.barrier()
    after = runtime.stats()
    barrier_sent = after["bytes_sent"] - before["bytes_sent"]
    barrier_received = after["bytes_received"] - before["bytes_received"]
    for elements in (n * 300_000, 300_001, 1001):
        data = np.ones(elements, np.float32)
        before = runtime.stats()
        runtime.allreduce(data, out=data)
        runtime.barrier()
        after = runtime.stats()
        counters.append(
            {
                "nbytes": data.nbytes,
                "sent": after["bytes_sent"] - before["bytes_sent"] - barrier_sent,
                "received": after["bytes_received"] - before["bytes_received"] - barrier_received,
            }
        )

    if with_64mib:

        def big():
            data = np.full(16 << 20, rank + 1, np.float32)  # 64 MiB
            runtime.allreduce(data, out=data)
            expected = n * (n + 1) / 2
            assert data[0] == expected and data[-1] == expected and np.all(data == expected)

        check("allreduce 64 MiB", big)

    communicator = runtime.communicator()
    p2p, segment = communicator.p2p, communicator._host_segment
    paths = {
        "shared_memory": p2p.shared_memory_peers,
        "data_socket": p2p.data_socket_peers,
        "single_copy": segment is not None and segment.single_copy,
    }
    write_report(
        results_dir, rank, {"rank": rank, "size": n, "failures": failures, "counters": counters, "paths": paths}
    )
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], "--64mib" in sys.argv)
