"""The GPUs of the local launcher's workers: ``elasticdl-strategy run --gpus-per-worker G``.

Every worker has a slot, 0 .. ``--workers``-1 (its ``EDL_LOCAL_RANK``); the worker
in slot i gets GPUs ``[i*G, (i+1)*G)`` of the launcher's GPUs through
``CUDA_VISIBLE_DEVICES``, so it sees those only (TensorFlow numbers them from 0
again). A replacement worker takes the slot, and so the GPUs, of the worker it
replaces, which has exited; standbys have slots of their own. So ``--workers`` x
G GPUs are needed, standbys included.

The launcher's GPUs: those its own ``CUDA_VISIBLE_DEVICES`` names when it is
set (indices or UUIDs; ``CUDA_VISIBLE_DEVICES=2,3 elasticdl-strategy run ...``
hands out GPUs 2 and 3), else every GPU ``nvidia-smi -L`` lists. When neither tells (no ``nvidia-smi``),
indices 0, 1, ... are handed out unchecked. G = 0 (the default) leaves
``CUDA_VISIBLE_DEVICES`` alone: every worker sees what the launcher sees.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from typing import Callable, List, Mapping, Optional, Tuple

from elasticdl_strategy.environment import CUDA_VISIBLE_DEVICES
from elasticdl_strategy.errors import ConfigError

_NVIDIA_SMI_TIMEOUT_S = 30.0
_GPU_LINE = re.compile(r"^GPU \d+:")  # "GPU 0: NVIDIA H100 (UUID: GPU-...)"; MIG devices are indented


def parse_visible_devices(text: str) -> List[str]:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value names, read as CUDA reads it: up to the first
    empty entry or negative index (``"-1"`` or ``""`` hide every GPU).

    >>> parse_visible_devices("0, 2,GPU-8e1c"), parse_visible_devices(""), parse_visible_devices("1,-1,2")
    (['0', '2', 'GPU-8e1c'], [], ['1'])
    """
    gpus: List[str] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry or re.fullmatch(r"-\d+", entry):
            break
        gpus.append(entry)
    return gpus


def count_listed(nvidia_smi_output: str) -> int:
    """How many GPUs ``nvidia-smi -L`` listed (MIG devices under a GPU are not counted).

    >>> count_listed("GPU 0: NVIDIA H100 (UUID: GPU-a)\\nGPU 1: NVIDIA H100 (UUID: GPU-b)\\n")
    2
    """
    return sum(1 for line in nvidia_smi_output.splitlines() if _GPU_LINE.match(line))


def list_with_nvidia_smi() -> Optional[str]:
    """What ``nvidia-smi -L`` prints ("" when it finds no device); ``None`` when it is missing or fails."""
    path = shutil.which("nvidia-smi")
    if path is None:
        return None
    try:
        result = subprocess.run([path, "-L"], capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return "" if "No devices were found" in result.stdout + result.stderr else None
    return result.stdout


@dataclasses.dataclass(frozen=True)
class GpuPool:
    """The GPUs the launcher hands out (``None``: unknown, indices from 0 unchecked) and where it learned them."""

    gpus: Optional[Tuple[str, ...]]
    source: str

    @classmethod
    def discover(
        cls, env: Mapping[str, str], nvidia_smi: Callable[[], Optional[str]] = list_with_nvidia_smi
    ) -> "GpuPool":
        """The launcher's GPUs: its ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``, else unknown."""
        if CUDA_VISIBLE_DEVICES in env:
            text = env[CUDA_VISIBLE_DEVICES]
            return cls(tuple(parse_visible_devices(text)), f"{CUDA_VISIBLE_DEVICES}={text!r}")
        listed = nvidia_smi()
        if listed is None:
            return cls(None, f"{CUDA_VISIBLE_DEVICES} unset and no answer from nvidia-smi -L")
        return cls(tuple(str(i) for i in range(count_listed(listed))), "nvidia-smi -L")

    def check(self, slots: int, per_worker: int) -> None:
        """Raises ConfigError when ``slots`` workers of ``per_worker`` GPUs do not fit (if the count is known)."""
        needed = slots * per_worker
        if self.gpus is not None and len(self.gpus) < needed:
            raise ConfigError(
                f"--gpus-per-worker={per_worker} needs {needed} GPUs for {slots} workers, "
                f"but this machine has {len(self.gpus)} ({self.source})"
            )

    def for_slot(self, slot: int, per_worker: int) -> str:
        """``CUDA_VISIBLE_DEVICES`` of the worker in ``slot``: GPUs ``[slot*G, (slot+1)*G)`` of the pool.

        >>> GpuPool(("4", "5", "6", "7"), "").for_slot(1, 2), GpuPool(None, "").for_slot(2, 1)
        ('6,7', '2')
        """
        first = slot * per_worker
        if self.gpus is None:
            return ",".join(str(i) for i in range(first, first + per_worker))
        return ",".join(self.gpus[first : first + per_worker])
