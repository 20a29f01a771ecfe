"""Durable checkpoints of an elastic state, written atomically by one worker.

Layout of ``directory``::

    commit-00000040/state.index, state.data-*   tf.train.Checkpoint of the state's variables
    commit-00000040/meta.pickle                  commit id, data position, Python values
    latest                                        name of the newest complete checkpoint

A checkpoint is written into a temporary directory which is then renamed,
and ``latest`` is replaced atomically after that, so a crash at any moment
leaves the previous checkpoint usable.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from elasticdl_strategy.elastic.snapshot import Snapshot
from elasticdl_strategy.errors import UsageError

_LATEST = "latest"


class CheckpointStore:
    """Saves and loads the checkpoints of one job in ``directory`` (keeps the newest ``keep``)."""

    def __init__(self, directory: str, keep: int = 2):
        if keep < 1:
            raise UsageError(f"keep={keep} must be at least 1")
        self.directory = directory
        self.keep = keep

    def save(self, variables: Sequence[tf.Variable], snapshot: Snapshot) -> str:
        """Writes ``snapshot`` (``variables`` hold its arrays) and returns its directory."""
        os.makedirs(self.directory, exist_ok=True)
        name = f"commit-{snapshot.commit_id:08d}"
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".tmp-{name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        tf.train.Checkpoint(variables=list(variables)).write(os.path.join(tmp, "state"))
        meta = {
            "commit_id": snapshot.commit_id,
            "position": snapshot.position,
            "values": snapshot.values,
            "shapes": [tuple(a.shape) for a in snapshot.arrays],
        }
        with open(os.path.join(tmp, "meta.pickle"), "wb") as f:
            pickle.dump(meta, f)
        # On disk before it is named: a power loss must not leave "latest" naming empty files.
        _fsync_files_and_directory(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_directory(self.directory)  # the checkpoint's name, before "latest" points to it
        latest_tmp = os.path.join(self.directory, f".{_LATEST}.tmp")
        with open(latest_tmp, "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(self.directory, _LATEST))
        _fsync_directory(self.directory)
        self._prune(keep_name=name)
        return final

    def _prune(self, keep_name: str) -> None:
        names = sorted(n for n in os.listdir(self.directory) if n.startswith("commit-"))
        for old in names[: -self.keep]:
            if old != keep_name:
                shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)

    def latest(self) -> Optional[str]:
        """Directory of the newest complete checkpoint, or ``None``."""
        try:
            with open(os.path.join(self.directory, _LATEST)) as f:
                name = f.read().strip()
        except FileNotFoundError:
            return None
        path = os.path.join(self.directory, name)
        return path if os.path.isdir(path) else None

    def load(self, variables: Sequence[tf.Variable]) -> Optional[Snapshot]:
        """Assigns the newest checkpoint to ``variables``; returns its snapshot, or ``None``.

        Raises:
            UsageError: the checkpoint does not fit the state (different variables).
        """
        path = self.latest()
        if path is None:
            return None
        with open(os.path.join(path, "meta.pickle"), "rb") as f:
            meta = pickle.load(f)
        variables = list(variables)
        shapes = [tuple(v.shape) for v in variables]
        if shapes != meta["shapes"]:
            raise UsageError(
                f"checkpoint {path} holds {len(meta['shapes'])} variables of shapes that differ from this "
                f"state's {len(shapes)}: it belongs to another model"
            )
        tf.train.Checkpoint(variables=variables).read(os.path.join(path, "state")).assert_existing_objects_matched()
        arrays = [np.array(v.numpy(), copy=True) for v in variables]
        return Snapshot(arrays, meta["values"], meta["position"], meta["commit_id"])


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise  # some filesystems (network, FUSE) cannot sync a directory: their renames are as durable as they get
    finally:
        os.close(fd)


def _fsync_files_and_directory(path: str) -> None:
    """Flushes every file under ``path``, then the directories, to stable storage."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_directory(root)
