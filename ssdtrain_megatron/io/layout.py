"""On-disk layout: per-job, per-rank directories under each root.

Each configured root (one per drive) gets one directory per rank and process,
``ssdtrain.<job>.<hostname>.rank<rank>.pid<pid>``, created 0700, holding an ``owner.json``
(so ``ssdtrain clean`` can tell live jobs from dead ones) and one slab file per root, opened
0600 without following links. Tensors live in extents of the slab (``extents.py``); no file
is created in the hot path.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from dataclasses import dataclass
from typing import Dict, List, Optional

from .owner import hold_owner_lock, owner_record

DIR_PREFIX = "ssdtrain."
OWNER_FILE = "owner.json"
ALIGN = 4096
_MKDIR_TRIES = 5


class LayoutError(RuntimeError):
    """A root or directory cannot be used safely; the message says which and why."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Identity:
    """Who this process is, for path templates and directory names."""

    rank: int
    local_rank: int
    hostname: str
    job: str

    @classmethod
    def detect(cls, job: str) -> "Identity":
        """Rank from torch.distributed when initialised, else RANK/LOCAL_RANK, else 0."""
        rank = local_rank = None
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
        except Exception:  # pragma: no cover - torch without distributed
            rank = None
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank if "RANK" not in os.environ else 0)))
        return cls(rank=rank, local_rank=local_rank, hostname=socket.gethostname(), job=job)


def expand_root(template: str, ident: Identity) -> str:
    """The root a path template names for this process.

    Raises LayoutError when a placeholder's value is not one plain path component (it would
    move the root elsewhere: ``..``, ``/``, empty), or when a directory named by a placeholder
    (a job or rank directory) already exists as a symlink, world-writable without the sticky
    bit, or owned by another user: someone else could then redirect our files. The fixed part
    of the template is the user's choice and may hold symlinks."""
    values = {"rank": ident.rank, "local_rank": ident.local_rank, "hostname": ident.hostname, "job": ident.job}
    for key, value in values.items():
        text = str(value)
        if text in ("", ".", "..") or "/" in text or "\x00" in text:
            raise LayoutError(f"{{{key}}}={text!r} cannot be used in the offload path {template!r}: "
                              "a placeholder must expand to one plain path component")
    path, templated = "/", False
    for part in os.path.abspath(os.path.expanduser(template)).split("/")[1:]:
        templated = templated or "{" in part
        path = os.path.join(path, part.format(**values))
        if templated:
            _check_templated_dir(path, template)
    return path


def expand_file(template: str, ident: Identity) -> str:
    """The file a path template (``stats_path``, ``trace_path``) names for this process.

    Its directories are checked as :func:`expand_root` checks a root's; the file itself may
    already exist (a restarted job appends to it) but must then be a plain file: not a
    directory, and not a symlink where a placeholder put it. Raises LayoutError otherwise."""
    path = os.path.abspath(os.path.expanduser(template))
    parent, name = os.path.split(path)
    directory = expand_root(parent, ident) if "{" in template else parent
    values = {"rank": ident.rank, "local_rank": ident.local_rank, "hostname": ident.hostname, "job": ident.job}
    full = os.path.join(directory, name.format(**values))
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return full
    what = f"{full!r}" + (f" (from the template {template!r})" if "{" in template else "")
    if stat.S_ISLNK(st.st_mode):
        if "{" in name:
            raise LayoutError(f"{what} is a symlink where this rank's file should be; refusing to follow "
                              "it. Remove it, or name the link's target in the path")
        st = os.stat(full)
    if stat.S_ISDIR(st.st_mode):
        raise LayoutError(f"{what} is a directory; this setting names a file (one per rank with "
                          "{rank}), which later runs append to")
    if not stat.S_ISREG(st.st_mode):
        raise LayoutError(f"{what} is not a plain file")
    return full


def job_levels(template: str) -> int:
    """How many trailing components of the root ``template`` names belong to one job: those
    from the first component that holds ``{job}`` on (0 without ``{job}``). A job removes
    these directories when they are empty after it closes; the ones above it are shared."""
    parts = os.path.abspath(os.path.expanduser(template)).split("/")[1:]
    for i, part in enumerate(parts):
        if "{job}" in part:
            return len(parts) - i
    return 0


def prune_empty(path: str, levels: int) -> List[str]:
    """Remove ``path`` and then its parents, ``levels`` directories in all, while each is
    empty, ours and not a mount point; stop at the first that is not. Returns those removed.
    (rmdir never removes a directory that has gained an entry meanwhile.)"""
    removed: List[str] = []
    uid = os.getuid()
    for _ in range(levels):
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or (uid != 0 and st.st_uid != uid) or os.path.ismount(path):
                break
            os.rmdir(path)
        except OSError:  # not empty, gone, or not ours to remove
            break
        removed.append(path)
        path = os.path.dirname(path)
    return removed


def _check_templated_dir(path: str, template: str) -> None:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        # Created later by make_rank_dir, as a plain 0700 directory; a file above it is the
        # root's problem (roots.py says so).
        return
    what = f"{path!r} (from the template {template!r})"
    if stat.S_ISLNK(st.st_mode):
        raise LayoutError(f"{what} is a symlink where a job directory should be; refusing to follow it. "
                          "Remove it, or put the link's target in dirs")
    if not stat.S_ISDIR(st.st_mode):
        raise LayoutError(f"{what} is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise LayoutError(f"{what} is world-writable without the sticky bit; chmod 700 it")
    if st.st_uid not in (os.getuid(), 0):
        raise LayoutError(f"{what} belongs to uid {st.st_uid}, not to us; refusing to write under it")


def rank_dir_name(job: str, hostname: str, rank: int, pid: int) -> str:
    """``ssdtrain.<job>.<host>.rank<r>.pid<pid>``: one directory per rank and process."""
    return f"{DIR_PREFIX}{job}.{hostname}.rank{rank}.pid{pid}"


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still allocate on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def space_shortfalls(dirs: List[str], need: Optional[List[int]]) -> Dict[str, str]:
    """Per directory whose free space is below what ``need`` (bytes, one per directory) asks,
    one line saying how much is missing; empty when ``need`` does not match ``dirs``."""
    if not need or len(need) != len(dirs):
        return {}
    short = {}
    for d, n in zip(dirs, need):
        free = free_bytes(d)
        if n > free:
            short[d] = (f"the next step needs about {n / 2**20:.1f} MiB in {d} but only "
                        f"{free / 2**20:.1f} MiB are free: {(n - free) / 2**20:.1f} MiB missing; "
                        "writes that do not fit will stay in memory (counted in "
                        "StepStats.fallbacks)")
    return short


def expand_roots(templates: List[str], ident: Identity) -> List[str]:
    """The roots ``templates`` name for this process; two templates naming one root are refused
    (two slabs of one rank in one directory would collide)."""
    roots = [expand_root(t, ident) for t in templates]
    for i, r in enumerate(roots):
        if r in roots[:i]:
            raise LayoutError(f"dirs[{i}] expands to {r!r}, the same root as dirs[{roots.index(r)}]")
    return roots


def make_rank_dirs(roots: List[str], ident: Identity, templates: Optional[List[str]] = None) -> List[str]:
    """This process's directory under every root; on a failure, the ones made are removed
    (with the job directories they leave empty, counted from ``templates``, the ``dirs`` the
    roots were expanded from). Nothing else is touched: sweeping dead jobs' leftovers is the
    caller's explicit step (:func:`clean.sweep_before_start`)."""
    levels = [job_levels(t) for t in templates] if templates else [0] * len(roots)
    made: List[str] = []
    try:
        for r in roots:
            made.append(make_rank_dir(r, ident))
    except BaseException:
        for d, n in zip(made, levels):
            remove_rank_dir(d, n)
        for r, n in zip(roots[len(made):], levels[len(made):]):
            prune_empty(r, n)  # the job directories os.makedirs made before the failure
        raise
    return made


def _check_root(root: str) -> None:
    """Refuse roots that another user could swap under us."""
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        # A symlinked root is the user's choice (e.g. /scratch -> /mnt/nvme0); resolve it and
        # check the target instead.
        st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise LayoutError(f"offload root {root!r} is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise LayoutError(f"offload root {root!r} is world-writable without the sticky bit; "
                          f"use a private directory (chmod 700) or set the sticky bit (chmod +t)")


def make_rank_dir(root: str, ident: Identity) -> str:
    """Create this process's 0700 directory under ``root`` (creating ``root`` if missing)."""
    name = rank_dir_name(ident.job, ident.hostname, ident.rank, os.getpid())
    path = os.path.join(root, name)
    for attempt in range(_MKDIR_TRIES):
        os.makedirs(root, mode=0o700, exist_ok=True)
        _check_root(root)
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            kind = "a symlink" if os.path.islink(path) else "in use"
            raise LayoutError(f"{path!r} already exists ({kind}): another offloader of this process uses "
                              f"the same root, or something was put there; run `ssdtrain clean {root}`") from None
        except FileNotFoundError:
            # Another rank's sweep (or `ssdtrain clean`) removed the job directory, empty for
            # a moment, between our makedirs and mkdir: make it again.
            if attempt == _MKDIR_TRIES - 1:
                raise
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise LayoutError(f"{path!r} is not a directory owned by us")
    owner = owner_record(ident.job, ident.hostname, ident.rank)
    fd = open_private(os.path.join(path, OWNER_FILE), os.O_WRONLY)
    hold_owner_lock(fd, owner)  # held for this process's life: how a sweep tells it runs (owner.py)
    try:
        os.write(fd, json.dumps(owner).encode())
    finally:
        os.close(fd)
    return path


def open_private(path: str, flags: int) -> int:
    """Create a new 0600 file, never following a link and never reusing an existing file."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def remove_rank_dir(path: str, levels: int = 0) -> None:
    """Remove a directory this process created: only plain files we know of, then the dir;
    then the ``levels`` directories above it (see :func:`job_levels`) that are left empty."""
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        entries = None
    for name in entries or ():
        full = os.path.join(path, name)
        try:
            if not stat.S_ISREG(os.lstat(full).st_mode):
                raise LayoutError(f"unexpected non-file {full!r} in offload directory; not removing it")
            os.unlink(full)
        except FileNotFoundError:
            pass
    if entries is not None:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
    prune_empty(os.path.dirname(path), levels)
