"""From TensorFlow tensors to the ring: bucketed all-reduce and all-gather.

Tensors to all-reduce are fused into *buckets*: grouped by dtype and packed,
in REVERSE list order (a model's last layers first, whose gradients backprop
computes first), into buckets of at most ``bucket_bytes``; a larger tensor gets
a bucket of its own. The plan (:func:`plan_buckets`) depends only on the
tensors' dtypes and static sizes, so it is the same on every rank, and so is
the order of the ring all-reduces, one per bucket.

Inside a ``tf.function`` every bucket crosses into Python through its own
stateful ``tf.numpy_function`` (~0.3 ms a call; ``py_function`` costs ~5 ms)
whose inputs are that bucket's tensors only. Every collective op of a graph is
ordered by :mod:`~elasticdl_strategy.strategy.ordering`'s token, so the buckets
(and every other collective, in whatever function, branch or loop iteration it
lies) run in program order on every rank (``tests/strategy/test_buckets.py``
checks the chain in the traced graph), and bucket k starts as soon as ITS
gradients exist and bucket k-1 is done, while backprop still computes the
earlier layers' ones.
Eagerly, the ring is called directly, bucket after bucket.

Devices: the ring works on host memory. A replica on a GPU hands the bridge
its device (``device=``): each ``numpy_function`` is pinned to that device's
host CPU (it only has a CPU kernel; TensorFlow's soft placement would move it
there anyway, but pinned it also works with soft placement off), TensorFlow
copies its inputs device -> host, and the reduced tensors are copied back onto
the replica's device once, here, so that the optimizer updates the GPU
variables from device memory (TensorFlow would copy a host tensor to the GPU
by itself wherever it is read, once per reader). On a CPU replica nothing is
copied.

A bucket is packed into a staging buffer kept between calls (keyed by the
bucket's layout). Every tensor starts on a 64-byte boundary there, so the
reduced tensors are handed to TensorFlow as views, without a copy; each view
holds a lease on its buffer until it is collected, and a buffer is reused only
once no lease is left, else another one is made (two are kept per use of a
layout in a step). Where the workers of one host read each other's memory (the
communicator's single copy, for buckets larger than its host segment's slots),
a bucket's tensors are not packed at all: each worker reads the others' tensors
where they lie and writes only the reduced values into its staging buffer
(:meth:`~elasticdl_strategy.collective.communicator.Communicator.allreduce_pieces`).

Measured on the 2-core development VM (``benchmarks/train_step.py``, MLP with
16 MiB of float32 gradients, N = 2): one 64 MiB bucket trains fastest; 16 and
4 MiB buckets cost ~10 % (every ring call costs a few ms there, and backprop
and the ring compete for the same two cores), and reductions do start before
backprop ends. Packing bucket k+1 on a helper thread while bucket k is on the
ring measured neither better nor worse, so buckets are simply reduced in turn.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from elasticdl_strategy import runtime
from elasticdl_strategy.errors import CommunicationError, UsageError
from elasticdl_strategy.strategy import ordering
from elasticdl_strategy.strategy.tf_compat import control_flow_util, device_util, ops

# The fastest of 4, 16 and 64 MiB for the MLP of benchmarks/train_step.py on 2 cores (one bucket).
DEFAULT_BUCKET_BYTES = 64 << 20
COMPRESSIONS = ("fp16", "bf16")
# Offsets of the tensors in a staging buffer: TensorFlow wraps an output array aligned
# to EIGEN_MAX_ALIGN_BYTES (64) without copying it; an unaligned one is copied.
_ALIGN_BYTES = 64
_COMPRESSIBLE = (np.dtype(np.float32), np.dtype(np.float64))

# Measurement switch (benchmarks/train_step.py), read when a function is traced:
# one numpy_function per bucket (else one for all the buckets of a call).
_OVERLAP = True


# ---- the bucket plan (pure Python) ----------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """Tensors fused into one all-reduce: indices into the caller's list, in packing order."""

    dtype: np.dtype
    members: Tuple[int, ...]


def _alignment(dtype: np.dtype) -> int:
    """Elements per 64 bytes (1 for an item size that does not divide 64)."""
    itemsize = max(1, dtype.itemsize)
    return _ALIGN_BYTES // itemsize if _ALIGN_BYTES % itemsize == 0 else 1


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def bucket_layout(sizes: Sequence[int], dtype) -> Tuple[List[int], int]:
    """(element offset of each tensor, total elements) of a staging buffer: every tensor
    starts on a 64-byte boundary; the padding between them stays zero.

    >>> bucket_layout([3, 20, 1], "float32")  # 16 float32 elements are 64 bytes
    ([0, 16, 48], 49)
    """
    align = _alignment(np.dtype(dtype))
    offsets, end = [], 0
    for size in sizes:
        start = _round_up(end, align)
        offsets.append(start)
        end = start + int(size)
    return offsets, end


def plan_buckets(
    sizes: Sequence[Optional[int]], dtypes: Sequence, bucket_bytes: int, reverse: bool = True
) -> List[Bucket]:
    """Groups tensors into buckets; the same inputs give the same plan on every rank.

    Args:
        sizes: number of elements of each tensor; ``None`` for a size not known
            when a function is traced (such a tensor gets a bucket of its own).
        dtypes: dtype of each tensor; a bucket holds one dtype.
        bucket_bytes: most bytes of a bucket, the 64-byte alignment of every
            tensor in it included; a larger tensor is a bucket on its own.
        reverse: pack from the last tensor to the first (gradients of a
            model's last layers, computed first by backprop, go first).

    Returns:
        the buckets in the order to reduce them: by the position (in packing
        order) of their last tensor, i.e. by when they become complete.
        Inside a bucket, members are in packing order.
    """
    if len(sizes) != len(dtypes):
        raise ValueError(f"{len(sizes)} sizes but {len(dtypes)} dtypes")
    order = range(len(sizes) - 1, -1, -1) if reverse else range(len(sizes))
    done: List[Tuple[int, Bucket]] = []  # (packing position of its last member, bucket)
    open_buckets: Dict[np.dtype, Tuple[List[int], int, int]] = {}  # dtype -> (members, padded bytes, last position)
    for position, index in enumerate(order):
        dtype = np.dtype(dtypes[index])
        size = sizes[index]
        nbytes = None if size is None else _round_up(int(size), _alignment(dtype)) * dtype.itemsize
        if nbytes is None or nbytes > bucket_bytes:
            done.append((position, Bucket(dtype, (index,))))
            continue
        members, used, _ = open_buckets.get(dtype, ([], 0, -1))
        if members and used + nbytes > bucket_bytes:
            done.append((open_buckets[dtype][2], Bucket(dtype, tuple(members))))
            members, used = [], 0
        members.append(index)
        open_buckets[dtype] = (members, used + nbytes, position)
    for dtype, (members, _, last) in open_buckets.items():
        done.append((last, Bucket(dtype, tuple(members))))
    done.sort(key=lambda item: item[0])
    return [bucket for _, bucket in done]


# ---- staging buffers ------------------------------------------------------------------------


class _StagingBuffer:
    """One staging buffer and its leases: busy while its bucket is being reduced and while any
    result view handed out from it is alive."""

    __slots__ = ("owner", "leases")

    def __init__(self, nbytes: int):
        self.owner = np.zeros(nbytes + _ALIGN_BYTES, np.uint8)
        self.leases = 0

    def view(self, dtype: np.dtype, length: int) -> np.ndarray:
        start = -self.owner.ctypes.data % _ALIGN_BYTES
        return self.owner[start : start + length * dtype.itemsize].view(dtype)


class _StagingPool:
    """Staging buffers kept between calls, keyed by bucket layout, for the ``max_layouts``
    layouts used last, handed out under explicit leases.

    :meth:`acquire` leases an idle buffer to the caller; :meth:`lend` leases it
    again to each result view handed to TensorFlow, which may hold such a view
    (zero-copy: it keeps a reference to that very array) past the call; the
    view's lease ends when it is collected (``weakref.finalize``), the caller's
    with :meth:`release`. A buffer is reused only when no lease is left. Two
    buffers per use of a layout in a step are kept: one may still be held while
    the other is filled.
    """

    def __init__(self, max_layouts: int = 256):
        self._max_layouts = max_layouts
        self._buffers: "collections.OrderedDict[tuple, List[_StagingBuffer]]" = collections.OrderedDict()
        # Reentrant: a lease may end (garbage collection) while this thread holds the lock.
        self._lock = threading.RLock()
        self.allocations = 0

    def acquire(self, key: tuple, nbytes: int, uses: int = 1) -> _StagingBuffer:
        """An idle buffer of ``nbytes`` (zero where no tensor lies), leased to the caller,
        for a layout that ``uses`` buckets of a step share."""
        with self._lock:
            buffers = self._buffers.get(key)
            if buffers is None:
                buffers = self._buffers[key] = []
                while len(self._buffers) > self._max_layouts:
                    self._buffers.popitem(last=False)
            else:
                self._buffers.move_to_end(key)
            buffer = next((b for b in buffers if b.leases == 0), None)
            if buffer is None:
                buffer = _StagingBuffer(nbytes)
                self.allocations += 1
                if len(buffers) < 2 * uses:
                    buffers.append(buffer)
            buffer.leases += 1
            return buffer

    def lend(self, buffer: _StagingBuffer, view: np.ndarray) -> np.ndarray:
        """Leases ``buffer`` to ``view`` until the view is collected; returns the view."""
        with self._lock:
            buffer.leases += 1
        weakref.finalize(view, self.release, buffer)
        return view

    def release(self, buffer: _StagingBuffer) -> None:
        with self._lock:
            buffer.leases -= 1


_pool = _StagingPool()


def _layout_key(dtype: np.dtype, sizes: Sequence[Optional[int]]) -> tuple:
    return (np.dtype(dtype).str, tuple(sizes))


def _layout_uses(keys: Sequence[tuple]) -> Dict[tuple, int]:
    return dict(collections.Counter(keys))


_counters: Dict[str, float] = {"reductions": 0, "buckets": 0, "pack_s": 0.0, "ring_s": 0.0}


def counters() -> Dict[str, float]:
    """Since the process started: ``reductions`` (calls of the ring all-reduce path),
    ``buckets`` (ring all-reduces of a bucket), ``staging_allocations`` (staging buffers made),
    ``pack_s`` (seconds spent copying tensors into staging buffers), ``ring_s`` (seconds in the
    buckets' all-reduces, waiting for the other workers included)."""
    return {**_counters, "staging_allocations": _pool.allocations}


# ---- reducing buckets -----------------------------------------------------------------------


class _Staged:
    """One bucket of one call: its staging buffer and where each member lies in it."""

    __slots__ = ("bucket", "dtype", "flat", "offsets", "key", "length", "buffer")

    def __init__(self, arrays: Sequence[np.ndarray], bucket: Bucket):
        dtype = arrays[bucket.members[0]].dtype
        sizes = [arrays[i].size for i in bucket.members]
        self.offsets, self.length = bucket_layout(sizes, dtype)
        self.bucket = bucket
        self.dtype = dtype
        self.key = _layout_key(dtype, sizes)
        self.flat: Optional[np.ndarray] = None  # the staging buffer's view while leased
        self.buffer: Optional[_StagingBuffer] = None

    def acquire(self, uses: Dict[tuple, int]) -> None:
        self.buffer = _pool.acquire(self.key, self.length * self.dtype.itemsize, uses.get(self.key, 1))
        self.flat = self.buffer.view(self.dtype, self.length)

    def _leased(self) -> Tuple[_StagingBuffer, np.ndarray]:
        assert self.buffer is not None and self.flat is not None, "acquire() first"
        return self.buffer, self.flat

    def pack(self, arrays: Sequence[np.ndarray]) -> None:
        _, flat = self._leased()
        for i, offset in zip(self.bucket.members, self.offsets, strict=True):
            array = arrays[i]
            flat[offset : offset + array.size] = array.reshape(-1)

    def reduce(self, communicator, op: str, timeout: Optional[float], compression: Optional[str]) -> None:
        _, flat = self._leased()
        kwargs = {}
        if compression is not None and flat.dtype in _COMPRESSIBLE:
            kwargs["compression"] = compression
        communicator.allreduce(flat, op=self._op(op), out=flat, timeout=timeout, **kwargs)
        self._finish(communicator, op)

    def reads_in_place(self, communicator, compression: Optional[str]) -> bool:
        """Whether the bucket's members are read where they lie, never packed (one host, single copy:
        :meth:`~elasticdl_strategy.collective.communicator.Communicator.reads_pieces`)."""
        if compression is not None and self.dtype in _COMPRESSIBLE:
            return False
        return communicator.reads_pieces(self.length * self.dtype.itemsize, len(self.bucket.members))

    def reduce_in_place(self, arrays: Sequence[np.ndarray], communicator, op: str, timeout: Optional[float]) -> None:
        _, flat = self._leased()
        members = [np.ascontiguousarray(arrays[i]) for i in self.bucket.members]
        communicator.allreduce_pieces(members, self.offsets, flat, op=self._op(op), timeout=timeout)
        self._finish(communicator, op)

    def _op(self, op: str) -> str:
        """What the communicator reduces with: the sum for an integer mean (see :meth:`_finish`)."""
        return "sum" if self._integer_mean(op) else op

    def _integer_mean(self, op: str) -> bool:
        return op == "mean" and self.dtype.kind in "iu"

    def _finish(self, communicator, op: str) -> None:
        _, flat = self._leased()
        if self._integer_mean(op):  # the sum, divided here with integer division
            flat //= communicator.size
        _counters["buckets"] += 1

    def unpack(self, arrays: Sequence[np.ndarray], results: List[np.ndarray]) -> None:
        buffer, flat = self._leased()
        for i, offset in zip(self.bucket.members, self.offsets, strict=True):
            array = arrays[i]
            results[i] = _pool.lend(buffer, flat[offset : offset + array.size].reshape(array.shape))
        self.abandon()  # from here only the results hold the buffer

    def abandon(self) -> None:
        """Ends this call's lease on its buffer (once)."""
        if self.buffer is not None:
            _pool.release(self.buffer)
        self.flat = self.buffer = None


def reduce_buckets(
    arrays: Sequence[np.ndarray],
    buckets: Sequence[Bucket],
    op: str,
    timeout: Optional[float] = None,
    compression: Optional[str] = None,
    uses: Optional[Dict[tuple, int]] = None,
    in_place: bool = True,
) -> List[np.ndarray]:
    """All-reduces ``arrays`` bucket by bucket, in the order of ``buckets``; returns the
    results (views of staging buffers) in the order of ``arrays``.

    ``uses``: how many buckets of a step share each layout (default: counted in ``buckets``).
    ``in_place``: whether other workers may read ``arrays`` where they lie (where the communicator
    does that: :meth:`_Staged.reads_in_place`); not for copies of a GPU's tensors, which TensorFlow
    may put in pinned memory that the kernel does not let another process read.
    """
    arrays = [np.asarray(a) for a in arrays]
    results: List[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
    _counters["reductions"] += 1
    if not buckets:
        return results
    communicator = runtime.communicator()
    staged = [_Staged(arrays, bucket) for bucket in buckets]
    if uses is None:
        uses = _layout_uses([bucket.key for bucket in staged])
    try:
        for bucket in staged:
            bucket.acquire(uses)
        for bucket in staged:
            started = packed = time.perf_counter()
            if in_place and bucket.reads_in_place(communicator, compression):
                bucket.reduce_in_place(arrays, communicator, op, timeout)
            else:
                bucket.pack(arrays)
                packed = time.perf_counter()
                bucket.reduce(communicator, op, timeout, compression)
            _counters["pack_s"] += packed - started
            _counters["ring_s"] += time.perf_counter() - packed
            bucket.unpack(arrays, results)
    finally:  # a failed reduction gives its buffers back
        for bucket in staged:
            bucket.abandon()
    return results


def allreduce_arrays(
    arrays: Sequence[np.ndarray],
    op: str,
    timeout: Optional[float] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    compression: Optional[str] = None,
    in_place: bool = True,
) -> List[np.ndarray]:
    """All-reduces ``arrays`` in buckets of at most ``bucket_bytes``; returns the results in the same order.

    ``op`` "mean" of integer arrays is the sum floor-divided by the number of
    workers, as TensorFlow's strategies do (Keras asks for it on label batches).
    ``compression`` ("fp16", "bf16") applies to float32 and float64 buckets only.
    """
    arrays = [np.asarray(a) for a in arrays]
    buckets = plan_buckets([a.size for a in arrays], [a.dtype for a in arrays], bucket_bytes)
    return reduce_buckets(arrays, buckets, op, timeout, compression, in_place=in_place)


def _briefly(function):
    """Raises communication errors without the stack of the ring: TensorFlow logs the stack of
    every exception raised in a ``numpy_function``, and a peer's failure needs no 30-frame trace."""

    def call(*args):
        try:
            return function(*args)
        except CommunicationError as error:
            raise error.with_traceback(None) from None

    return call


def _check_not_xla() -> None:
    if control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise UsageError(
            "AllReduceStrategy cannot reduce inside an XLA-compiled function: the ring runs in Python, "
            "which XLA cannot call. Compile without XLA (model.compile(jit_compile=False), "
            "tf.function(jit_compile=False))."
        )


def _on(device: Optional[str]):
    """A device scope (nothing for ``None``: ``ops.device(None)`` would clear the caller's)."""
    return contextlib.nullcontext() if device is None else ops.device(device)


def _host_of(device: Optional[str]) -> Optional[str]:
    """Where a collective runs: the host CPU of the replica's device."""
    return None if device is None else device_util.get_host_for_device(device)


def _on_host(device: Optional[str]) -> bool:
    """Whether the replica's device is its host's CPU (its tensors lie in ordinary host memory)."""
    return device is None or device == _host_of(device)


def _onto(device: Optional[str], tensors: List[tf.Tensor]) -> List[tf.Tensor]:
    """The ring's results (in host memory) copied once onto the replica's device, if that is not the host."""
    if _on_host(device):
        return tensors
    with ops.device(device):
        return [tf.identity(t) for t in tensors]


def _static_size(tensor: tf.Tensor) -> Optional[int]:
    return tensor.shape.num_elements() if tensor.shape.is_fully_defined() else None


def all_reduce_tensors(
    tensors: Sequence[tf.Tensor],
    op: str,
    timeout: Optional[float] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    compression: Optional[str] = None,
    device: Optional[str] = None,
) -> List[tf.Tensor]:
    """All-reduces ``tensors`` (``op`` "sum" or "mean") across workers; works eagerly and in graphs.

    In a graph, each bucket is its own stateful ``numpy_function`` (see the module docstring).
    ``device``: the replica's device, where the results are placed (the ring runs on its host).
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    if tf.executing_eagerly():
        arrays = [t.numpy() for t in tensors]
        arrays = allreduce_arrays(arrays, op, timeout, bucket_bytes, compression, in_place=_on_host(device))
        with _on(device):
            return [tf.convert_to_tensor(a) for a in arrays]
    _check_not_xla()
    sizes = [_static_size(t) for t in tensors]
    buckets = plan_buckets(sizes, [t.dtype.as_numpy_dtype for t in tensors], bucket_bytes)
    # Buffers to keep per layout: counted over the step's buckets, not one numpy_function's.
    uses = _layout_uses([_layout_key(b.dtype, [sizes[i] for i in b.members]) for b in buckets])
    if _OVERLAP:
        groups = [(b.members, [Bucket(b.dtype, tuple(range(len(b.members))))]) for b in buckets]
    else:
        groups = [(tuple(range(len(tensors))), buckets)]
    results: List[tf.Tensor] = [None] * len(tensors)
    for members, plan in groups:
        inputs = [tensors[i] for i in members]
        reduce = _briefly(
            functools.partial(
                _reduce_call,
                plan=plan,
                op=op,
                timeout=timeout,
                compression=compression,
                uses=uses,
                in_place=_on_host(device),
            )
        )

        def collective_op(inputs=inputs, reduce=reduce) -> List[tf.Tensor]:
            dtypes = [t.dtype for t in inputs]
            with _on(_host_of(device)):
                return _as_list(tf.numpy_function(reduce, inputs, dtypes, stateful=True, name="elasticdl_allreduce"))

        outputs = _onto(device, ordering.ordered(collective_op))
        for i, output in zip(members, outputs, strict=True):
            output.set_shape(tensors[i].shape)
            results[i] = output
    return results


def _as_list(outputs) -> List[tf.Tensor]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _reduce_call(*arrays, plan, op, timeout, compression, uses, in_place):
    return reduce_buckets(arrays, plan, op, timeout, compression, uses, in_place)


def all_gather_tensor(
    tensor: tf.Tensor, axis: int, timeout: Optional[float] = None, device: Optional[str] = None
) -> tf.Tensor:
    """Concatenates every worker's ``tensor`` along ``axis`` (whose size may differ per worker).

    ``device``: the replica's device, where the result is placed (the ring runs on its host).
    """
    tensor = tf.convert_to_tensor(tensor)

    def gather(array: np.ndarray) -> np.ndarray:
        moved = np.moveaxis(np.asarray(array), axis, 0)
        return np.ascontiguousarray(np.moveaxis(runtime.communicator().allgather(moved, timeout=timeout), 0, axis))

    if tf.executing_eagerly():
        gathered = gather(tensor.numpy())
        with _on(device):
            return tf.convert_to_tensor(gathered)
    _check_not_xla()

    def collective_op() -> List[tf.Tensor]:
        with _on(_host_of(device)):
            gathered = tf.numpy_function(
                _briefly(gather), [tensor], tensor.dtype, stateful=True, name="elasticdl_allgather"
            )
        return [gathered]

    (output,) = _onto(device, ordering.ordered(collective_op))
    shape = tensor.shape.as_list()
    if shape:
        shape[axis] = None
    output.set_shape(shape if tensor.shape.rank is not None else None)
    return output


def all_reduce_indexed_slices(
    slices: tf.IndexedSlices, op: str, timeout: Optional[float] = None, device: Optional[str] = None
) -> tf.IndexedSlices:
    """Reduces a sparse gradient (e.g. of an embedding) by all-gathering its rows.

    The result lists every worker's rows in rank order, which is the order of
    the global batch (each worker holds a contiguous share of it): the very
    IndexedSlices one process computes on the global batch, an id repeated in
    the batch appearing once per occurrence. Rows are not summed per id first:
    sparse updates of Adam, Adagrad and RMSprop square each occurrence's row
    (then add them up), so a sum made first trains another model than one
    process. The wire cost is the rows the batch touched, occurrences counted.
    """
    indices = all_gather_tensor(tf.cast(slices.indices, tf.int64), axis=0, timeout=timeout, device=device)
    values = all_gather_tensor(slices.values, axis=0, timeout=timeout, device=device)
    if op == "mean":
        with _on(device):
            values = values / tf.cast(runtime.size(), values.dtype)
    return tf.IndexedSlices(values, indices, slices.dense_shape)
