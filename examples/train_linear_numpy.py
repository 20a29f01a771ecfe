"""Data-parallel training with the collective API: linear regression by SGD on N workers.

Run on 2 local workers::

    elasticdl-strategy run --workers 2 -- python examples/train_linear_numpy.py

Every worker holds a different shard of a synthetic data set, computes the
gradient of the mean squared error on its shard, and averages gradients with
``runtime.allreduce(op="mean")`` — the step that ``AllReduceStrategy``
hides behind ``tf.distribute``. Rank 0 starts from random weights that it
broadcasts, so every worker trains the same model; at the end the workers
check that their weights are bitwise identical and that the loss fell.
"""

import argparse
import sys

import numpy as np

from elasticdl_strategy import runtime


def make_shard(rank: int, size: int, samples: int, features: int, seed: int = 0):
    """This worker's rows of a data set y = X @ w_true + noise (the same w_true everywhere)."""
    w_true = np.random.default_rng(seed).standard_normal(features)
    rng = np.random.default_rng([seed, rank])
    rows = samples // size + (1 if rank < samples % size else 0)
    x = rng.standard_normal((rows, features))
    y = x @ w_true + 0.01 * rng.standard_normal(rows)
    return x, y


def global_loss(x, y, w) -> float:
    """Mean squared error over every worker's rows."""
    sums = runtime.allreduce(np.array([np.sum((x @ w - y) ** 2), len(y)], np.float64))
    return float(sums[0] / sums[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    runtime.init()
    rank, size = runtime.rank(), runtime.size()
    x, y = make_shard(rank, size, args.samples, args.features)
    w = runtime.broadcast(np.random.default_rng([2, rank]).standard_normal(args.features), root=0)
    rng = np.random.default_rng([1, rank])

    initial = global_loss(x, y, w)
    for step in range(args.steps):
        batch = rng.integers(0, len(y), args.batch)
        error = x[batch] @ w - y[batch]
        grad = 2 * x[batch].T @ error / args.batch
        w -= args.lr * runtime.allreduce(grad, op="mean")
        if rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss {global_loss(x, y, w):.6f}", flush=True)
        elif step % 50 == 0:
            global_loss(x, y, w)  # every rank takes part in the same collectives
    final = global_loss(x, y, w)

    same = runtime.allgather(w[None, :])
    identical = all(np.array_equal(same[0], same[i]) for i in range(size))
    print(f"rank {rank}/{size}: loss {initial:.4f} -> {final:.6f}, weights identical on all ranks: {identical}")
    runtime.shutdown()
    return 0 if identical and final < initial / 100 else 1


if __name__ == "__main__":
    sys.exit(main())
