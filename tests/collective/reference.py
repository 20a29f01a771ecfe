"""Inputs every rank can rebuild from a seed, and numpy references for the collectives."""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from elasticdl_strategy.collective.dtypes import SUPPORTED_DTYPES

# Relative tolerance of a float reduction whose order differs from numpy's.
RTOL = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-5, "float64": 1e-12}


def make_input(seed: int, rank: int, shape: Sequence[int], dtype: str, op: str = "sum") -> np.ndarray:
    """Small integer-valued data: exact in every dtype, no overflow for N <= 4."""
    rng = np.random.default_rng([seed, rank])
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    low, high = (1, 3) if op == "prod" else (-8, 9)
    if dtype == "uint8":
        low, high = max(low, 0), high
    values = rng.integers(low, high, size=shape)
    return values.astype(SUPPORTED_DTYPES[dtype])


def reduce_reference(inputs: List[np.ndarray], op: str) -> np.ndarray:
    wide = [x.astype(np.float64) if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x for x in inputs]
    if op in ("sum", "mean"):
        result = wide[0].copy()
        for x in wide[1:]:
            result = result + x
        if op == "mean":
            result = result / len(inputs)
    elif op == "prod":
        result = wide[0].copy()
        for x in wide[1:]:
            result = result * x
    elif op == "min":
        result = np.minimum.reduce(wide)
    else:
        result = np.maximum.reduce(wide)
    return np.asarray(result).astype(inputs[0].dtype)


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    name = actual.dtype.name
    if name in RTOL:
        np.testing.assert_allclose(
            actual.astype(np.float64), expected.astype(np.float64), rtol=RTOL[name], atol=RTOL[name]
        )
    else:
        np.testing.assert_array_equal(actual, expected)


def assert_identical(results: Sequence[np.ndarray]) -> None:
    """Bitwise identical on every rank."""
    first = results[0]
    for rank, other in enumerate(results[1:], start=1):
        assert other.dtype == first.dtype and other.shape == first.shape
        assert other.tobytes() == first.tobytes(), f"rank {rank} differs from rank 0"
