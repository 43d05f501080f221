"""Which offload roots may be used: a root must exist, and where it lies is said out loud.

A root is the part of a ``dirs`` template above its first ``{job}`` component, with every
other placeholder filled in (``/mnt/nvme{local_rank}/ssdtrain/{job}`` -> ``/mnt/nvme0/ssdtrain``
for local rank 0); without ``{job}``, the whole expanded template. Below a root a job creates
only what it removes again: its job folders (from the ``{job}`` component on, see
``layout.job_levels``) and its rank folders. A root that does not exist is refused, because
the usual reason is a drive that is not mounted, and creating the path then writes the
activations onto the system disk (and leaves the folders behind). ``create_dirs`` (flag
``--ssd-offload-create-dirs``) creates it anyway; ``ssdtrain demo``, ``bench``, ``io-bench`` and
``soak`` create their own ``--dir``.

Two placements work but waste the drives, and get a warning when the offloader starts: a root
on the filesystem of ``/`` (a full drive stops the machine), and two roots on one drive
(striping over them gains no bandwidth). ``ssdtrain doctor`` reports the same, from this code.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Dict, List, Optional, Sequence, Tuple

from .dirfd import trust_problem
from .layout import Identity, LayoutError, expand_root, job_levels, make_dirs
from .where import describe, filesystem_notes, filesystem_of, settings

log = logging.getLogger(__name__)

MISSING = "missing"
NOT_A_DIRECTORY = "not a directory"
CREATE_HINT = "--ssd-offload-create-dirs / create_dirs: true creates it anyway"


def root_of(template: str, ident: Identity) -> str:
    """The root ``template`` names for this process: the expanded path above its first
    ``{job}`` component (the whole expanded path without ``{job}``)."""
    path = expand_root(template, ident)
    for _ in range(job_levels(template)):
        path = os.path.dirname(path)
    return path


def root_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be an offload root as it is (None when it can): ``missing``, ``not a
    directory``, or one someone else could change under us (``dirfd.trust_problem``: another
    user's, or writable by group or others without the sticky bit). A symlink to a directory
    is fine (the user's choice, e.g. /scratch -> /mnt/nvme0)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return NOT_A_DIRECTORY + " (a broken symlink)" if os.path.islink(path) else MISSING
    except NotADirectoryError:
        return NOT_A_DIRECTORY + " (a part of the path is a file)"
    if not stat.S_ISDIR(st.st_mode):
        return NOT_A_DIRECTORY
    return trust_problem(st)


def check_roots(templates: Sequence[str], ident: Identity, create: bool = False) -> List[str]:
    """The root of every template, each checked by :func:`check_root`; a missing one is
    created (0700, with its parents) only when ``create``.

    Raises:
        LayoutError: one line naming the first root that cannot be used and what is wrong."""
    return [check_root(template, ident, create, index=i) for i, template in enumerate(templates)]


def check_root(template: str, ident: Identity, create: bool = False, index: int = 0) -> str:
    """The root ``template`` (``dirs[index]``) names for ``ident``, checked by
    :func:`root_problem`; a missing one is created (0700, with its parents) only when
    ``create``.

    Raises:
        LayoutError: one line naming the root, what is wrong with it and what to do."""
    root = root_of(template, ident)
    problem = root_problem(root)
    if problem == MISSING and create:
        make_dirs(root)  # each missing folder 0700 whatever the umask
        log.warning("ssdtrain: created the offload root %s (create_dirs); it stays after the job",
                    root)
        problem = root_problem(root)
    where = f"offload root {root}" + (f" (dirs[{index}] {template!r})" if template != root else "")
    if problem == MISSING:
        raise LayoutError(f"{where} does not exist: mount the drive or create it; we create only "
                          f"our job and rank folders below a root ({CREATE_HINT})")
    if problem is not None and problem.startswith(NOT_A_DIRECTORY):
        raise LayoutError(f"{where} is {problem}: point --ssd-offload-dir (dirs) at a directory "
                          "on the drive, or move what is there out of the way")
    if problem is not None:
        raise LayoutError(f"{where} is {problem}")
    return root


def drive_of(path: str) -> Tuple[object, str]:
    """(an id of the drive holding ``path``, its name): partitions of one disk share the disk's
    id (from /sys/dev/block); elsewhere the filesystem's device number and /proc/mounts name."""
    st_dev = os.stat(path).st_dev
    name = filesystem_of(path)[1]
    link = f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        real = os.path.realpath(link, strict=True)
    except (OSError, TypeError):
        return st_dev, name
    disk = os.path.dirname(real) if os.path.exists(os.path.join(real, "partition")) else real
    return os.path.basename(disk), f"/dev/{os.path.basename(disk)}"


def on_system_disk(path: str) -> bool:
    """Whether ``path`` lies on the filesystem of ``/`` (the system disk); OSError when it
    cannot be looked at."""
    return os.stat(path).st_dev == os.stat("/").st_dev


def root_warnings(paths: Sequence[str]) -> List[str]:
    """Warnings for roots (or directories in them) that work but waste the drives: one on the
    filesystem of ``/``, and two or more on one drive. Paths that do not exist are skipped."""
    warnings: List[str] = []
    by_drive: Dict[object, List[str]] = {}
    names: Dict[object, str] = {}
    for p in dict.fromkeys(paths):  # each path once
        try:
            same_as_system = on_system_disk(p)
            drive, name = drive_of(p)
        except OSError:
            continue
        if same_as_system:
            warnings.append(f"offload directory {p} is on the same filesystem as / ({name}): filling it "
                            "can stop the machine; put the roots on node-local NVMe (--ssd-offload-dir)")
        by_drive.setdefault(drive, []).append(p)
        names[drive] = name
    for drive, group in by_drive.items():
        if len(group) > 1:
            warnings.append(f"offload directories {', '.join(group)} are on one drive ({names[drive]}): "
                            "striping over them gains nothing; give one root per drive")
    return warnings


def log_roots(directories: List[str], config=None) -> List[str]:
    """When an offloader starts: its settings (INFO), one INFO line per directory saying where
    it writes (device and free space), and a WARNING for one that is not on an SSD, on the
    filesystem of / or on the same drive as another (io/roots.py). Returns the warnings."""
    warnings = []
    if config is not None:
        log.info("ssdtrain: %s", settings(config))
    for d in directories:
        log.info("ssdtrain: offload files in %s: %s", d, describe(d))
        for note in filesystem_notes(filesystem_of(d)[0]):
            warnings.append(f"ssdtrain: offload directory {d} is {note} (set --ssd-offload-dir / dirs)")
    warnings += [f"ssdtrain: {w}" for w in root_warnings(directories)]
    for msg in warnings:
        log.warning(msg)
    return warnings
