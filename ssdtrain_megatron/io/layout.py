"""On-disk layout: per-job, per-rank directories under each root.

Each configured root (one per drive) gets one directory per rank and process,
``ssdtrain.<job>.<hostname>.rank<rank>.pid<pid>``, created 0700, holding an ``owner.json``
(so ``ssdtrain clean`` can tell live jobs from dead ones) and one slab file per root, opened
0600 without following links. Tensors live in extents of the slab (``extents.py``); no file
is created in the hot path.

The rank directory and the job folders above it are made and opened through descriptors,
one component at a time, each checked on the descriptor that is then used (``dirfd.py``);
the rank directory stays open (:class:`RankDir`) and every file of ours in it is created,
listed and removed relative to it, so no other user can steer where our files go or which
files we delete.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import pwd
import socket
import stat
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .dirfd import DirChain, LayoutError, open_chain, remove_entry_dir, vanished_text
from .owner import hold_owner_lock, owner_record
from .private_file import file_problem

log = logging.getLogger(__name__)

DIR_PREFIX = "ssdtrain."
OWNER_FILE = "owner.json"
ALIGN = 4096
_MKDIR_TRIES = 5


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Identity:
    """Who this process is, for path templates and directory names."""

    rank: int
    local_rank: int
    hostname: str
    job: str
    user: str = field(default_factory=lambda: current_user())
    """``{user}``: the login name of the user this process runs as (its uid where the passwd
    database has no name for it, as in many containers)."""

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


def current_user() -> str:
    """The login name of this process's user, or its uid as text where it has none."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def expand_root(template: str, ident: Identity) -> str:
    """The root a path template names for this process.

    Raises LayoutError when a placeholder's value is not one plain path component (it would
    move the root elsewhere: ``..``, ``/``, empty), or when a directory named by a placeholder
    (a job or rank directory) already exists as a symlink, as something else than a directory,
    or as one that someone else could change (:func:`dirfd.trust_problem`: another user's, or
    writable by group or others without the sticky bit), looked at through descriptors, as
    :func:`make_rank_dir` does again when it creates them. The fixed part of the template is
    the user's choice and may hold symlinks."""
    values = _values(ident)
    for key, value in values.items():
        text = str(value)
        if text in ("", ".", "..") or "/" in text or "\x00" in text:
            raise LayoutError(f"{{{key}}}={text!r} cannot be used in the offload path {template!r}: "
                              "a placeholder must expand to one plain path component")
    path = "/"
    for part in os.path.abspath(os.path.expanduser(template)).split("/")[1:]:
        path = os.path.join(path, part.format(**values))
    base = fixed_part(template)
    if base != path and os.path.isdir(base):
        # Checked now, before anything is swept there; missing ones are made (and checked
        # again, on the descriptors then used) by make_rank_dir.
        open_chain(path, create=False, base=base, what=f" (from the template {template!r})",
                   check_base=False).close()
    return path


def _values(ident: Identity) -> Dict[str, object]:
    return {"rank": ident.rank, "local_rank": ident.local_rank, "hostname": ident.hostname, "job": ident.job,
            "user": ident.user}


def fixed_part(template: str) -> str:
    """The directories of ``template`` above its first placeholder (the user's own path)."""
    parts = os.path.abspath(os.path.expanduser(template)).split("/")[1:]
    fixed = [p for p in itertools.takewhile(lambda p: "{" not in p, parts)]
    return "/" + "/".join(fixed)


def expand_file(template: str, ident: Identity) -> str:
    """The file a path template (``stats_path``, ``trace_path``) names for this process.

    Its directories are checked as :func:`expand_root` checks a root's; the file itself may
    already exist (a restarted job appends to it) but must then be one we may append to
    (:func:`private_file.file_problem`: a plain file of ours that nobody else may write, not a
    symlink, not a FIFO, not a directory). Raises LayoutError otherwise. The folders and the
    file are made, opened and judged again through descriptors at the first line
    (``telemetry/append.py``), from :func:`file_base`."""
    path = os.path.abspath(os.path.expanduser(template))
    parent, name = os.path.split(path)
    directory = expand_root(parent, ident) if "{" in template else parent
    full = os.path.join(directory, name.format(**_values(ident)))
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return full
    what = f"{full!r}" + (f" (from the template {template!r})" if "{" in template else "")
    problem = file_problem(st)
    if problem:
        raise LayoutError(f"{what} is {problem}")
    return full


def file_base(template: str) -> str:
    """Where the walk to the folder of a file ``template`` names starts, opened by path: the
    directories above its first placeholder (the whole folder of a fixed path)."""
    return fixed_part(os.path.dirname(os.path.abspath(os.path.expanduser(template))))


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


def rank_dir_name(job: str, hostname: str, rank: int, pid: int) -> str:
    """``ssdtrain.<job>.<host>.rank<r>.pid<pid>``: one directory per rank and process."""
    return f"{DIR_PREFIX}{job}.{hostname}.rank{rank}.pid{pid}"


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still allocate on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def space_shortfalls(dirs: List[str], need: Optional[List[int]]) -> Dict[str, str]:
    """Per directory whose free space is below what ``need`` (bytes, one per directory) asks,
    one line saying how much is missing; empty when ``need`` does not match ``dirs``.

    Raises LayoutError (one line naming the directory and the likely cause) for a directory
    that is gone (removed, or its drive unmounted) instead of statvfs's bare OSError."""
    if not need or len(need) != len(dirs):
        return {}
    short = {}
    for d, n in zip(dirs, need):
        try:
            free = free_bytes(d)
        except OSError as exc:
            raise LayoutError(vanished_text(d, exc) + "; the job cannot keep its activations there") from None
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


class RankDir(os.PathLike):
    """This process's directory under one root, held open for the job's life (dirfd.py):
    ``path`` names it in messages and for other processes; every create, unlink, list and
    remove of ours goes through ``fd``, so a path changed under us steers none of them.
    ``levels``: the job folders above it (:func:`job_levels`), removed with it when empty."""

    def __init__(self, chain: DirChain, levels: int = 0) -> None:
        self._chain = chain
        self.path = chain.path
        self.levels = levels
        self.removed = False

    @property
    def fd(self) -> int:
        return self._chain.fd

    @property
    def proc_path(self) -> str:
        """A path to the held directory itself (/proc/self/fd/N), for code that takes a
        directory name: whatever now has our directory's name is not where it lands."""
        return f"/proc/self/fd/{self.fd}"

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"RankDir({self.path!r})"

    def open_file(self, name: str, flags: int) -> int:
        """Create the new 0600 file ``name`` in it (never following a link, never reusing one)."""
        return os.open(name, flags | _NEW_FILE, 0o600, dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass  # removed with its directory already (the exit path, then close)

    def remove(self, levels: Optional[int] = None) -> None:
        """Remove our plain files, the directory, then the job folders above it that it leaves
        empty (``levels``, by default its own). Never raises: a directory that is gone has
        nothing left to remove, and one on a read-only filesystem is left, said in one line."""
        if self.removed or not self._chain.fds:
            return
        self.removed = True
        chain, fd = self._chain, self.fd
        try:
            for name in os.listdir(fd):
                if not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    log.warning("ssdtrain: unexpected non-file %r in offload directory %s; not removing it",
                                name, self.path)
                    return
                self.unlink(name)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("ssdtrain: %s; left %s in place (`ssdtrain clean` removes it once it can)",
                            vanished_text(self.path, exc), self.path)
            return
        if not remove_entry_dir(chain.fds[-2], chain.names[-1], fd):
            return  # gone already, or not where we made it (then not ours to look above)
        uid = os.getuid()
        for i in range(len(chain.fds) - 2, len(chain.fds) - 2 - (self.levels if levels is None else levels), -1):
            owner = os.fstat(chain.fds[i]).st_uid
            if i <= 0 or (uid != 0 and owner != uid) or not remove_entry_dir(chain.fds[i - 1], chain.names[i],
                                                                            chain.fds[i]):
                break

    def close(self) -> None:
        """Let go of the descriptors (only once no IO thread may create a file in it)."""
        self._chain.close()


_NEW_FILE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def make_rank_dirs(roots: List[str], ident: Identity, templates: Optional[List[str]] = None) -> List[RankDir]:
    """This process's directory under every root; on a failure, the ones made are removed
    (with the job folders they made, counted from ``templates``, the ``dirs`` the roots were
    expanded from). Nothing else is touched: sweeping dead jobs' leftovers is the caller's
    explicit step (:func:`clean.sweep_before_start`)."""
    made: List[RankDir] = []
    try:
        for i, r in enumerate(roots):
            made.append(make_rank_dir(r, ident, templates[i] if templates else None))
    except BaseException:
        for d in made:
            remove_rank_dir(d)
        raise
    return made


def make_rank_dir(root: str, ident: Identity, template: Optional[str] = None) -> RankDir:
    """Create this process's 0700 directory under ``root`` (``template`` expanded), creating
    the folders missing between them, each 0700, one at a time through descriptors from the
    template's fixed part (without ``template``: from the deepest existing directory above
    ``root``); every one of them is checked (:func:`dirfd.trust_problem`). A failure removes
    what this call created.

    Raises LayoutError: one line naming the directory that cannot be used and the fix."""
    name = rank_dir_name(ident.job, ident.hostname, ident.rank, os.getpid())
    base = fixed_part(template) if template else None
    what = f" (from the template {template!r})" if template else ""
    for attempt in range(_MKDIR_TRIES):
        chain: Optional[DirChain] = None
        try:
            chain = open_chain(root, create=True, base=base if base and os.path.isdir(base) else None,
                               what=what)
            chain.step(name, create=True, fresh=True)
            _write_owner(chain.fd, ident)
        except FileNotFoundError as exc:
            # Another rank's sweep (or `ssdtrain clean`) removed the job folder, empty for a
            # moment, between our mkdir of it and of ours in it: walk again.
            if chain is not None:
                chain.undo()
            if attempt == _MKDIR_TRIES - 1:
                raise LayoutError(vanished_text(root, exc)) from exc
            continue
        except BaseException:
            if chain is None:
                raise
            try:
                os.unlink(OWNER_FILE, dir_fd=chain.fd)
            except OSError:
                pass
            chain.undo()  # a failed start leaves nothing it made
            raise
        return RankDir(chain, job_levels(template) if template else 0)
    raise AssertionError("unreachable")  # pragma: no cover


def _write_owner(dir_fd: int, ident: Identity) -> None:
    fd = os.open(OWNER_FILE, os.O_WRONLY | _NEW_FILE, 0o600, dir_fd=dir_fd)
    try:
        owner = owner_record(ident.job, ident.hostname, ident.rank)
        hold_owner_lock(fd, owner)  # held for this process's life: how a sweep tells it runs (owner.py)
        os.write(fd, json.dumps(owner).encode())
    finally:
        os.close(fd)


def make_dirs(path: str) -> None:
    """``os.makedirs(path)`` made safe: every missing folder 0700 whatever the umask, made
    and checked through descriptors (:func:`dirfd.open_chain`). Raises LayoutError."""
    open_chain(path, create=True).close()


def open_private(path: str, flags: int) -> int:
    """Create a new 0600 file, never following a link and never reusing an existing file."""
    return os.open(path, flags | _NEW_FILE, 0o600)


def remove_rank_dir(d: RankDir, levels: Optional[int] = None, keep_open: bool = False) -> None:
    """Remove a directory this process created (:meth:`RankDir.remove`; never raises), then
    close its descriptors unless ``keep_open`` (an IO thread may still use them)."""
    d.remove(levels)
    if not keep_open:
        d.close()
