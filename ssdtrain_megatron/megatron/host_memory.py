"""Host memory free for a job on this node, measured where it starts: the measured side of
the engine that follows the node (plan/engine_choice.py holds the rule).

What is free: ``MemAvailable`` of /proc/meminfo, or less where the process's memory cgroup
(Slurm's ``--mem``, a container's limit) leaves less room under its limit; the node's local
ranks share it (``LOCAL_WORLD_SIZE``, as torchrun sets it, else ``SLURM_NTASKS_PER_NODE``).
Measured before Megatron starts (the launcher's hooks are applied before any rank of the job
pins memory), so every rank of a node sees the same figure; what megatron-core's optimizer CPU
offload will take of it (``--optimizer-cpu-offload``) is subtracted per rank by the one
sequence (plan/job.py, rule 0), not here.

``SSDTRAIN_HOST_MEMORY_FREE`` (a size: ``64GB``) replaces the measurement: for a node whose
limit neither figure shows, and for tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from ..plan.engine_choice import size
from ..sizes import EXPECTED, parse_size

FREE_ENV = "SSDTRAIN_HOST_MEMORY_FREE"
NO_LIMIT = 1 << 60
"""A cgroup limit at or above this is none (v1 reports 'unlimited' as about 2^63)."""


@dataclass(frozen=True)
class HostMemory:
    """Host memory free on the node at the job's start, and how many ranks share it."""

    free_bytes: int
    local_ranks: int
    source: str = "MemAvailable"
    """Where ``free_bytes`` comes from: MemAvailable, the memory cgroup, or FREE_ENV."""

    def describe(self) -> str:
        """'1.2 TB host memory free' (with its source when not MemAvailable)."""
        where = "" if self.source == "MemAvailable" else f" ({self.source})"
        return f"{size(self.free_bytes)} host memory free{where} for {self.local_ranks} local rank(s)"


def mem_available(path: str = "/proc/meminfo") -> Optional[int]:
    """MemAvailable in bytes, or None where the file or the line is missing."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else int(text)


def cgroup_room(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes the process's memory cgroup may still take (its limit less its usage), or None
    without a limit. cgroup v2 (``memory.max``, ``memory.current``) or v1 (``memory`` controller:
    ``memory.limit_in_bytes``, ``memory.usage_in_bytes``), in the process's own cgroup or, inside
    a container that shows only its own, at the root."""
    try:
        with open(proc, encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            files, base = ("memory.max", "memory.current"), root
        elif "memory" in controllers.split(","):
            files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), os.path.join(root, "memory")
        else:
            continue
        for folder in (os.path.join(base, path.lstrip("/")), base):
            limit, used = (_read_int(os.path.join(folder, f)) for f in files)
            if limit is not None and used is not None:
                return max(limit - used, 0) if limit < NO_LIMIT else None
    return None


def local_ranks(environ: Mapping[str, str] = os.environ) -> int:
    """Ranks of this job on this node: LOCAL_WORLD_SIZE, else SLURM_NTASKS_PER_NODE, else 1."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        text = environ.get(name, "").split("(")[0]  # Slurm may write '8(x2)'
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def measure(environ: Mapping[str, str] = os.environ) -> Optional[HostMemory]:
    """Host memory free on the node now, or None where it cannot be read (no /proc/meminfo).

    Raises:
        ValueError: FREE_ENV is set but is not a size (one line naming it).
    """
    ranks = local_ranks(environ)
    given = environ.get(FREE_ENV)
    if given:
        value = parse_size(given)
        if value is None:
            raise ValueError(f"{FREE_ENV}={given!r} is invalid: expected {EXPECTED}")
        return HostMemory(value, ranks, f"${FREE_ENV}")
    available = mem_available()
    if available is None:
        return None
    room = cgroup_room()
    if room is not None and room < available:
        return HostMemory(room, ranks, "the memory cgroup's limit")
    return HostMemory(available, ranks)


__all__ = ["FREE_ENV", "HostMemory", "cgroup_room", "local_ranks", "measure", "mem_available"]
