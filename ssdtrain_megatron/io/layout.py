"""On-disk layout: per-job, per-rank directories under each root, and slab extents.

Each configured root (one per drive) gets one directory per rank and process,
``ssdtrain.<job>.<hostname>.rank<rank>.pid<pid>``, created 0700, holding an ``owner.json``
(so ``ssdtrain clean`` can tell live jobs from dead ones) and one slab file per root, opened
0600 without following links. Tensors live in extents of the slab, handed out by
:class:`ExtentAllocator`; no file is created in the hot path.
"""

from __future__ import annotations

import bisect
import json
import os
import socket
import stat
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

DIR_PREFIX = "ssdtrain."
OWNER_FILE = "owner.json"
ALIGN = 4096


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


def _check_templated_dir(path: str, template: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # created later by make_rank_dir, as a plain 0700 directory
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


def expand_roots(templates: List[str], ident: Identity) -> List[str]:
    """The roots ``templates`` name for this process; two templates naming one root are refused
    (two slabs of one rank in one directory would collide)."""
    roots = [expand_root(t, ident) for t in templates]
    for i, r in enumerate(roots):
        if r in roots[:i]:
            raise LayoutError(f"dirs[{i}] expands to {r!r}, the same root as dirs[{roots.index(r)}]")
    return roots


def make_rank_dirs(roots: List[str], ident: Identity) -> List[str]:
    """This process's directory under every root; on a failure, the ones made are removed."""
    made: List[str] = []
    try:
        for r in roots:
            made.append(make_rank_dir(r, ident))
    except Exception:
        for d in made:
            remove_rank_dir(d)
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
    # Imported here: clean.py builds on this module (names, owner file).
    from .clean import owner_record, remove_stale

    os.makedirs(root, mode=0o700, exist_ok=True)
    _check_root(root)
    remove_stale(root, ident.hostname)  # leftovers of dead jobs (SIGKILL, crash, reboot)
    name = rank_dir_name(ident.job, ident.hostname, ident.rank, os.getpid())
    path = os.path.join(root, name)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        kind = "a symlink" if os.path.islink(path) else "in use"
        raise LayoutError(f"{path!r} already exists ({kind}): another offloader of this process uses the "
                          f"same root, or something was put there; run `ssdtrain clean {root}`") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise LayoutError(f"{path!r} is not a directory owned by us")
    owner = owner_record(ident.job, ident.hostname, ident.rank)
    fd = open_private(os.path.join(path, OWNER_FILE), os.O_WRONLY)
    try:
        os.write(fd, json.dumps(owner).encode())
    finally:
        os.close(fd)
    return path


def open_private(path: str, flags: int) -> int:
    """Create a new 0600 file, never following a link and never reusing an existing file."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def remove_rank_dir(path: str) -> None:
    """Remove a directory this process created: only plain files we know of, then the dir."""
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        return
    for name in entries:
        full = os.path.join(path, name)
        if not stat.S_ISREG(os.lstat(full).st_mode):
            raise LayoutError(f"unexpected non-file {full!r} in offload directory; not removing it")
        os.unlink(full)
    os.rmdir(path)


class ExtentAllocator:
    """First-fit allocator of aligned extents in a growable slab, with coalescing.

    Thread-safe. ``allocate`` never fails: it grows the slab when no free extent fits.
    """

    def __init__(self, align: int = ALIGN) -> None:
        self._align = align
        self._lock = threading.Lock()
        self._free_starts: List[int] = []  # sorted
        self._free: Dict[int, int] = {}  # start -> length
        self.size = 0  # slab size (high-water mark)
        self.allocated = 0

    def allocate(self, nbytes: int) -> int:
        n = align_up(max(nbytes, 1), self._align)
        with self._lock:
            for i, start in enumerate(self._free_starts):
                length = self._free[start]
                if length >= n:
                    del self._free[start]
                    self._free_starts.pop(i)
                    if length > n:
                        self._insert(start + n, length - n)
                    self.allocated += n
                    return start
            # Grow: extend a free extent that ends at the slab end, or append.
            if self._free_starts and self._free_starts[-1] + self._free[self._free_starts[-1]] == self.size:
                start = self._free_starts.pop()
                del self._free[start]
            else:
                start = self.size
            self.size = start + n
            self.allocated += n
            return start

    def free(self, start: int, nbytes: int) -> None:
        n = align_up(max(nbytes, 1), self._align)
        with self._lock:
            self.allocated -= n
            i = bisect.bisect_left(self._free_starts, start)
            # Coalesce with the previous and next free extents.
            if i > 0:
                prev = self._free_starts[i - 1]
                if prev + self._free[prev] == start:
                    start, n = prev, n + self._free[prev]
                    del self._free[prev]
                    self._free_starts.pop(i - 1)
                    i -= 1
            if i < len(self._free_starts) and start + n == self._free_starts[i]:
                nxt = self._free_starts.pop(i)
                n += self._free.pop(nxt)
            self._insert(start, n)

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free[start] = length

    def reset(self) -> None:
        with self._lock:
            self._free_starts.clear()
            self._free.clear()
            self.size = 0
            self.allocated = 0


@dataclass(slots=True)
class Extent:
    """One chunk of a stored tensor: which root's slab, where, how long (unpadded)."""

    root: int
    offset: int
    length: int
    crc: Optional[int] = None
