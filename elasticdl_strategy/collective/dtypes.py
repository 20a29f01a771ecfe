"""The array types and reduction operations the collectives support."""

from __future__ import annotations

from typing import Callable, Dict

import ml_dtypes
import numpy as np

from elasticdl_strategy.errors import UsageError

SUPPORTED_DTYPES: Dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}

_FLOATING = {"float16", "bfloat16", "float32", "float64"}

# Element-wise reductions applied in place: ``ufunc(acc, incoming, out=acc)``.
# "mean" reduces with add and divides once at the end.
REDUCE_UFUNCS: Dict[str, Callable] = {
    "sum": np.add,
    "mean": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
}


# dtype -> name by dict lookup: ``np.dtype.name`` runs Python code, and this is
# needed for every message on the ring's data path.
_NAMES: Dict[np.dtype, str] = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    return _NAMES.get(dtype) or dtype.name


def dtype_from_name(name: str) -> np.dtype:
    try:
        return SUPPORTED_DTYPES[name]
    except KeyError:
        raise UsageError(f"unsupported dtype {name!r}; supported: {', '.join(SUPPORTED_DTYPES)}") from None


def as_supported_array(array) -> np.ndarray:
    """Returns ``array`` as a C-contiguous, native-byte-order array of a supported dtype.

    Raises:
        UsageError: the dtype is not supported.
    """
    array = np.asarray(array)
    if array.dtype not in _NAMES:
        if array.dtype.kind in "biuf" and not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        if array.dtype not in _NAMES:
            raise UsageError(f"unsupported dtype {array.dtype}; supported: {', '.join(SUPPORTED_DTYPES)}")
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return array if array.flags.c_contiguous else array.copy(order="C")


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of the C-contiguous ``array`` as a flat memoryview of format "B" (no copy).

    Example::

        byte_view(np.ones(2, np.float32)).nbytes  # 8
    """
    try:
        return memoryview(array).cast("B")  # type: ignore[arg-type]  # 4x faster than numpy's reshape and view
    except (TypeError, ValueError):  # empty, or a dtype without a buffer format (bfloat16)
        return array.reshape(-1).view(np.uint8).data


def check_reduce_op(op: str, dtype: np.dtype) -> Callable:
    """Returns the ufunc of reduction ``op`` for ``dtype``.

    Raises:
        UsageError: unknown op, or one that is not meaningful for the dtype
            (``mean`` of integers or booleans, ``sum``/``prod`` of booleans).
    """
    if op not in REDUCE_UFUNCS:
        raise UsageError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_UFUNCS)}")
    name = dtype_name(dtype)
    if op == "mean" and name not in _FLOATING:
        raise UsageError(f"op='mean' needs a floating dtype, got {name}; use op='sum' and divide")
    if name == "bool" and op not in ("min", "max"):
        raise UsageError(f"op={op!r} is not defined for bool; use 'min' (logical and) or 'max' (logical or)")
    return REDUCE_UFUNCS[op]
