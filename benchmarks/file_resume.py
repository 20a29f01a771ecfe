"""What ``ElasticFiles`` pays to start mid-file: TensorFlow's ``skip`` against reading, per record.

A worker that resumes (after a failure, a join, a restart from a checkpoint) at
record k of a TFRecord file skips k records with ``skip``, which reads each
record's 12-byte header and seeks over its payload; a worker also reads the
bytes of the other workers' records in the runs it reads (it parses only its
own). This prints, per record size, the median time per record of reading a
file through and of skipping through it, over repeats, with the file in the
page cache (the second and later passes).

    python3 benchmarks/file_resume.py [--records 2000] [--repeats 7] [--dir /tmp/edl-file-resume]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import tensorflow as tf


def write(path: str, records: int, size: int) -> None:
    if os.path.exists(path):
        return
    rng = np.random.default_rng(0)
    with tf.io.TFRecordWriter(path) as writer:
        for _ in range(records):
            writer.write(rng.bytes(size))


def seconds(dataset: tf.data.Dataset) -> float:
    started = time.perf_counter()
    dataset.batch(256).reduce(np.int64(0), lambda n, _: n + 1).numpy()  # in the runtime: no Python per record
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default="/tmp/edl-file-resume")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"{args.records} records per file, median of {args.repeats} passes (page cache), load {load:.1f}")
    print(f"{'record':>8} {'read µs/record':>15} {'skip µs/record':>15} {'skip/read':>10}")
    for size in (1 << 10, 100 << 10):
        path = os.path.join(args.dir, f"records-{size}.tfrecord")
        write(path, args.records, size)
        read = [seconds(tf.data.TFRecordDataset(path)) for _ in range(args.repeats)]
        skip = [seconds(tf.data.TFRecordDataset(path).skip(args.records - 1)) for _ in range(args.repeats)]
        per_read = statistics.median(read) / args.records * 1e6
        per_skip = statistics.median(skip) / (args.records - 1) * 1e6
        print(f"{size >> 10:>6}KB {per_read:>15.2f} {per_skip:>15.2f} {per_skip / per_read:>10.2f}")


if __name__ == "__main__":
    main()
