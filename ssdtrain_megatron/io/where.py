"""Where the offloaded bytes land: the filesystem and device under each root, and a warning
when that is not an SSD (a root in RAM, a container's overlay, a network filesystem).

The default root, /tmp/ssdtrain, lands on whatever /tmp is: often tmpfs (RAM, so nothing is
saved) or the container's overlay. The offloader logs, when it starts, one line per root saying
where it writes, and a warning for such a root, so the choice is never silent.
"""

from __future__ import annotations

import os
import shutil
from typing import List, Tuple

IN_RAM = ("tmpfs", "ramfs")
CONTAINER = ("overlay", "aufs")
NETWORK = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "fuse.sshfs")


def filesystem_of(path: str) -> Tuple[str, str]:
    """(filesystem type, device) of the mount holding ``path``, from /proc/mounts (Linux);
    ('unknown', '?') where that cannot be read."""
    path = os.path.realpath(path)
    best = ("", "unknown", "?")
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                dev, mnt, fs = parts[0], parts[1].replace("\\040", " "), parts[2]
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, fs, dev)
    except OSError:
        pass
    return best[1], best[2]


def filesystem_notes(fs: str) -> List[str]:
    """What is wrong with offloading onto a filesystem of type ``fs`` (nothing for a local disk)."""
    if fs in IN_RAM:
        return ["in RAM (tmpfs), not on an SSD: offloading there saves no host memory"]
    if fs in CONTAINER:
        return ["a container's overlay filesystem: mount a host NVMe directory instead"]
    if fs in NETWORK:
        return ["a network filesystem: use node-local NVMe"]
    return []


def binary(n: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB), one decimal."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def describe(path: str) -> str:
    """'<free> free of <total> on <fs> (<device>)' for the drive holding ``path``."""
    fs, dev = filesystem_of(path)
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        return f"on {fs} ({dev}), free space unknown: {exc.strerror or exc}"
    return f"{binary(usage.free)} free of {binary(usage.total)} on {fs} ({dev})"


def settings(config, policy: bool = True) -> str:
    """The OffloadConfig fields that change what a run measures, with their values, in one line
    (``policy=False``: without the policy, for runs that try several)."""
    from .checksum import ALGORITHM

    return (f"engine {config.engine}, " + (f"policy {config.policy}, " if policy else "") +
            f"min_tensor_bytes {_min_bytes(config)}, keep_last_layers {config.keep_last_layers}, "
            f"prefetch_layers {config.prefetch_layers}, io_threads {config.io_threads}, chunk_bytes "
            f"{binary(config.chunk_bytes)}, max_inflight_bytes {binary(config.max_inflight_bytes)}, "
            f"verify {ALGORITHM if config.verify != 'off' else 'off'}")


def _min_bytes(config) -> str:
    """``min_tensor_bytes`` as set, or what it is by device."""
    if config.min_tensor_bytes is not None:
        return binary(config.min_tensor_bytes)
    return f"{binary(config.min_bytes_for('cuda'))} on CUDA, {binary(config.min_bytes_for('cpu'))} elsewhere"
