"""Who owns a rank directory, and whether that owner still runs: the ``owner.json`` record.

Liveness is told by a lock, not guessed from a pid. The process that creates a rank directory
takes an exclusive ``flock`` on its ``owner.json`` before it writes the record, and holds it
for its life (``hold_owner_lock``); the kernel drops it when the process ends, however it ends
(SIGKILL, an out-of-memory kill). A sweep (``judge_owner``) asks for a shared lock on the same
file: refused means the owner runs. That answer holds across pid namespaces and containers on
one kernel, where a pid means nothing.

A free lock alone proves death only where every possible holder shares our lock table:
- the record's boot id is ours: written by this kernel, which sees every lock on it;
- or the directory is on a filesystem only this kernel mounts (ext4, xfs, tmpfs, ...) and
  nothing in it changed since this kernel booted: written before a reboot.
Otherwise (another machine, or another boot, on a shared filesystem: NFS, Lustre, GPFS, ...,
where a flock may stay local to the machine that took it) the answer is "cannot tell":
neither a hostname nor a boot id decides alone (pods with fixed hostnames share filesystems;
another machine has another boot id). ``ssdtrain clean --older-than`` is for those.

A record without a lock (written by a version that took none, or where the filesystem
refused locks) is judged by its pid, start time and pid namespace, and only on this kernel.

Records are read as untrusted input (another user may have written the file we read as root):
``parse_owner`` bounds the size, the nesting and every field's type and range, and turns
anything else into ValueError, which the sweep reports as "unknown".
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import time
from typing import Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

LOCK = "flock"
"""The record's ``lock`` field when its writer holds the lock (None: it could not take one)."""
MAX_OWNER_BYTES = 4096
"""A record is a few hundred bytes; anything larger is not ours."""
MAX_DEPTH = 2
"""A record is one flat object; deeper nesting is refused before it is parsed."""
PID_MAX = 1 << 22
"""The largest pid any Linux kernel hands out (PID_MAX_LIMIT on 64-bit)."""
RANK_MAX = (1 << 31) - 1
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs",
                               "tmpfs", "ramfs", "overlay"})
"""Filesystems that only the kernel mounting them writes to: no other machine's process can hold
a lock there. Anything else (nfs, nfs4, lustre, gpfs, ceph, beegfs, fuse, 9p, ...) may be
shared, and a free lock there tells nothing about another machine."""

_held: List[Tuple[int, int, int]] = []
"""(fd, st_dev, st_ino) of each owner.json this process holds locked. Process-wide because the
lock must outlive the function that writes the record, and layout hands paths around, not
objects; an entry goes when its file has been unlinked (its directory removed) and in a forked
child (the lock is the parent's)."""


def boot_id() -> Optional[str]:
    """This boot of this kernel (Linux), or None where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def boot_time() -> Optional[float]:
    """When this kernel booted (seconds since the epoch, /proc/stat ``btime``), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def pid_namespace() -> Optional[str]:
    """The pid namespace of this process (``pid:[inode]``): pids mean something only inside it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start_ticks(pid: int) -> Optional[int]:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); None when
    there is no such process or no /proc. With the pid, this names one process for good."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    try:
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def owner_record(job: str, hostname: str, rank: int) -> dict:
    """What ``owner.json`` says about the process creating a rank directory now (``lock`` is
    set by :func:`hold_owner_lock`, which runs before the record is written)."""
    pid = os.getpid()
    return {"pid": pid, "hostname": hostname, "job": job, "rank": rank, "started": time.time(),
            "uid": os.getuid(), "boot_id": boot_id(), "pid_ns": pid_namespace(),
            "start_ticks": process_start_ticks(pid), "lock": None}


# -- the owner's side: hold the lock for the process's life -----------------------------------


def hold_owner_lock(fd: int, owner: dict) -> None:
    """Lock the freshly created ``owner.json`` open as ``fd`` for this process's life, and say
    so in ``owner`` (write the record after this call). The lock is taken on a duplicate, so
    the caller closes ``fd`` as usual. A filesystem that refuses locks costs only the lock:
    the record then says ``"lock": null`` and is judged by its pid."""
    _release_unlinked()
    # A read-only descriptor of its own (non-inheritable: an exec'd child does not keep the
    # job "alive"): one open for writing for the job's life would make a remount read-only
    # fail with EBUSY, and a root the kernel turns read-only must stay one warning (layout.py).
    try:
        dup = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no /proc: the writable descriptor's duplicate still locks
        dup = os.dup(fd)
    try:
        fcntl.flock(dup, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.fstat(dup)
    except OSError as exc:
        os.close(dup)
        log.info("ssdtrain: cannot lock owner.json (%s): a sweep judges this job by its pid",
                 exc.strerror or exc)
        owner["lock"] = None
        return
    _held.append((dup, st.st_dev, st.st_ino))
    owner["lock"] = LOCK


def held_locks() -> int:
    """How many owner records this process holds locked (for tests and diagnostics)."""
    _release_unlinked()
    return len(_held)


def _release_unlinked() -> None:
    """Drop the locks of records whose directory is gone (nothing can find them any more)."""
    keep = []
    for fd, dev, ino in _held:
        try:
            st = os.fstat(fd)
        except OSError:
            continue  # closed by someone else: nothing to release
        if (st.st_dev, st.st_ino) != (dev, ino):
            continue  # the number was closed and reused: not ours to close
        if st.st_nlink == 0:
            os.close(fd)
        else:
            keep.append((fd, dev, ino))
    _held[:] = keep


def _forget_in_child() -> None:
    # The parent holds the lock for the job; the child's copies would keep a dead parent's
    # directory "live" for as long as an orphaned worker runs.
    for fd, _dev, _ino in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


# -- the sweep's side: read a record, judge its owner -----------------------------------------


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def _depth(data: bytes) -> int:
    """How deeply ``data``'s JSON nests (brackets inside strings do not count)."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', data)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def _check_int(owner: dict, key: str, low: int, high: int, required: bool = True) -> None:
    value = owner.get(key)
    if value is None and not required:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"owner.json has {key} {value!r:.40} (allowed: an integer from {low} to {high})")


def _check_str(owner: dict, key: str, limit: int, required: bool = True) -> None:
    value = owner.get(key)
    if value is None and not required:
        return
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"owner.json has {key} {value!r:.40} (allowed: a string of at most {limit} characters)")


def parse_owner(data: bytes) -> dict:
    """The record in ``data``, checked; ValueError naming what is wrong (never another error:
    a record is another user's input when root sweeps)."""
    if len(data) > MAX_OWNER_BYTES:
        raise ValueError(f"owner.json is larger than {MAX_OWNER_BYTES} bytes")
    if _depth(data) > MAX_DEPTH:
        raise ValueError(f"owner.json nests deeper than {MAX_DEPTH} levels")
    owner = json.loads(data.decode("utf-8"))  # ValueError (JSONDecodeError, UnicodeDecodeError)
    if not isinstance(owner, dict):
        raise ValueError("owner.json is not a JSON object")
    _check_int(owner, "pid", 1, PID_MAX)
    _check_int(owner, "rank", 0, RANK_MAX)
    _check_str(owner, "hostname", 255)
    _check_str(owner, "job", 255)
    _check_int(owner, "start_ticks", 0, (1 << 63) - 1, required=False)
    _check_str(owner, "boot_id", 64, required=False)
    _check_str(owner, "pid_ns", 64, required=False)
    if owner.get("lock") not in (None, LOCK):
        raise ValueError(f"owner.json has lock {owner.get('lock')!r:.40} (allowed: {LOCK!r} or null)")
    return owner


def filesystem_type(fd: int) -> Optional[str]:
    """The type of the filesystem holding the open file ``fd`` (its mount, from
    /proc/self/fdinfo and /proc/self/mountinfo), or None where /proc does not say."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as fh:
            mnt_id = next(line.split()[1] for line in fh if line.startswith("mnt_id:"))
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if fields and fields[0] == mnt_id and "-" in fields:
                    return fields[fields.index("-") + 1]
    except (OSError, StopIteration, IndexError):
        pass
    return None


def lock_state(fd: int) -> Optional[bool]:
    """True if some process holds ``fd``'s file locked (its owner runs), False if not, None if
    this filesystem refuses file locks (cannot tell)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def last_change(dir_fd: int) -> float:
    """The newest modification time of the directory ``dir_fd`` and its entries (a step
    creates, writes and removes its slab there): when its owner last did something."""
    newest = os.fstat(dir_fd).st_mtime
    for name in os.listdir(dir_fd):
        try:
            newest = max(newest, os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime)
        except OSError:
            continue
    return newest


def judge_owner(owner: dict, owner_fd: int, dir_fd: int) -> Tuple[Optional[bool], str]:
    """(True, why) if the owner runs, (False, why) if it is gone, (None, why) if we cannot tell;
    ``owner`` is the parsed record of the file open as ``owner_fd`` in directory ``dir_fd``."""
    locked = lock_state(owner_fd)
    if locked:
        return True, "its owner.json is locked: the job runs"
    recorded_boot, now_boot = owner.get("boot_id"), boot_id()
    this_kernel = bool(recorded_boot and now_boot and recorded_boot == now_boot)
    if owner.get("lock") == LOCK and this_kernel:
        if locked is None:
            return None, "this filesystem refuses file locks now; cannot tell whether the job runs"
        return False, "no process holds its owner.json lock: the job is gone"
    if owner.get("lock") != LOCK and this_kernel:
        return _pid_alive(owner)
    fstype = filesystem_type(owner_fd)
    booted = boot_time()
    changed = last_change(dir_fd)
    if (recorded_boot and now_boot and fstype in LOCAL_FILESYSTEMS and booted is not None
            and changed < booted):
        return False, f"written before this node last booted, on a local {fstype} filesystem"
    return None, (f"written by another machine or an earlier boot (boot id {recorded_boot}) on "
                  f"{fstype or 'an unknown'} filesystem, last changed {human_age(time.time() - changed)} ago; a lock "
                  "taken there may not reach us: cannot tell whether the job runs")


def human_age(seconds: float) -> str:
    """``seconds`` as a person reads an age: 40 s, 12 min, 3.5 h, 2.0 d."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} d"


def _pid_alive(owner: dict) -> Tuple[Optional[bool], str]:
    """A record without a lock, written by this kernel: judge it by pid and start time."""
    pid = owner["pid"]
    ns = owner.get("pid_ns")
    if ns and ns != pid_namespace():
        return None, f"written from another pid namespace ({ns}, a container?) without a lock; cannot tell whether pid {pid} runs"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, f"pid {pid} is gone"
    except PermissionError:
        pass  # exists, belongs to another user
    ticks = owner.get("start_ticks")
    if isinstance(ticks, int):
        now = process_start_ticks(pid)
        if now is not None and now != ticks:
            return False, f"pid {pid} is gone (now reused by another process)"
    return True, f"pid {pid} is running"


# -- who holds a lock whose writer is gone ----------------------------------------------------


def holds_record(record: Optional[Tuple[int, int]]) -> bool:
    """Whether this process holds the lock of the owner.json with this (device, inode)."""
    _release_unlinked()
    return record is not None and any((dev, ino) == record for _fd, dev, ino in _held)


class OpenFiles:
    """Which processes have which files open, from /proc/<pid>/fd (only those this user may
    look at; root: all), read once, when first asked: a report that names the holders of many
    locks scans /proc once, not once per lock."""

    def __init__(self) -> None:
        self._index: Optional[Dict[Tuple[int, int], List[int]]] = None

    def pids(self, record: Tuple[int, int]) -> List[int]:
        """The pids (as this pid namespace numbers them) with the file of this (device, inode)
        open: the holders of its lock are among them."""
        if self._index is None:
            self._index = _scan_open_files()
        return self._index.get(record, [])


def _scan_open_files() -> Dict[Tuple[int, int], List[int]]:
    index: Dict[Tuple[int, int], List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return index
    for entry in sorted((e for e in entries if e.isdigit()), key=int):
        if int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        seen = set()
        for fd in fds:
            try:
                st = os.stat(f"/proc/{entry}/fd/{fd}")
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen.add(key)
                index.setdefault(key, []).append(int(entry))
    return index


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def orphaned_lock(owner: dict, record: Tuple[int, int], open_files: OpenFiles) -> Optional[str]:
    """For a record whose lock is held: when the process that wrote it is gone (judged on this
    boot, in this pid namespace, by pid and start time) the lock was kept by a process that
    shares its open file: a child forked from C (a library's ``fork()``, which runs none of
    Python's fork hooks, so the child keeps the descriptor ``hold_owner_lock`` made; one that
    execs drops it, close-on-exec). A line naming the holders and what to do; None when the
    writer runs or this cannot be told."""
    if owner.get("lock") != LOCK or owner.get("boot_id") != boot_id():
        return None
    if owner.get("pid_ns") != pid_namespace() or not isinstance(owner.get("start_ticks"), int):
        return None
    alive, why = _pid_alive(owner)
    if alive is not False:
        return None
    pids = open_files.pids(record)
    who = ", ".join(f"pid {p} ({_command(p)})" for p in pids) or \
        "a process this user cannot see (another user's, or in another pid namespace)"
    return (f"the job itself is gone ({why}) but its owner.json lock is held by {who}: a child it forked "
            "from C kept the lock; the directory is removed by the first sweep after that process ends "
            f"({'kill ' + ' '.join(map(str, pids)) if pids else 'find it with lsof'} if it is a leftover)")
