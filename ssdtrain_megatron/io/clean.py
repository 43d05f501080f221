"""Leftovers of dead jobs: find them under offload roots and remove them (``ssdtrain clean``).

A rank directory, ``ssdtrain.<job>.<host>.rank<r>.pid<pid>``, belongs to the process named in
its ``owner.json`` (``owner.py``), which holds a lock on that file for its life. Normal exit and
SIGINT/SIGTERM remove it (see cleanup.py); SIGKILL, a crash of the interpreter or a node reset
leave it behind. Every new disk engine, before it creates its own directories, sweeps every
directory its ``dirs`` templates name on this host, for any job and rank
(``sweep_before_start``: a job whose roots hold ``{job}`` finds the leftovers of other job ids
too; bounded, ``bounded_template_roots``: only the user's own directories, a limited number of
entries per listed directory), and ``ssdtrain clean`` (tools/clean.py, the command) does the
same on demand: below a ROOT at any depth (``clean_tree``), or from the templates of a preset
(``--config``) or of ``--dirs``. A sweep then removes the job folders it left empty
(``layout.prune_empty``; below a bare ROOT ``_prune_job_folders``), never a folder that was
empty before, a mount point, one above the first ``{job}`` component of a template, or, below
a ROOT, one above the folder named after the job id or owned by another user than the job's.

What counts as ours, and dead, is decided conservatively, because a mistake deletes a live
job's activations (it then fails at its next read) or someone else's files:
- only directories (never symlinks) whose name has our prefix, with a valid ``owner.json``
  (``owner.parse_owner``: size, nesting, every field's type and range; anything else is
  "unknown", never an error) whose host, rank and pid agree with the name, and owned by the
  user running the sweep (root may sweep anyone's);
- live means its ``owner.json`` is locked; dead means the lock is free and every holder would
  share our lock table: written by this kernel (same boot id: any pid namespace, any
  container), or before this node booted on a filesystem only this node mounts
  (``owner.judge_owner``). A record written without a lock is judged by its pid on this kernel;
- anything else (another machine or boot on a shared filesystem, another pid namespace
  without a lock): "cannot tell", left alone and reported; ``older_than`` (``ssdtrain clean
  --older-than``) removes those in which nothing changed for that long;
- inside, only plain files are removed, through directory file descriptors opened without
  following links; anything else (a subdirectory, a symlink, a socket) keeps the whole
  directory in place and is reported.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import glob
import logging
import os
import re
import socket
import stat
import string
import time
from typing import List, Optional, Sequence, Tuple

from .layout import DIR_PREFIX, OWNER_FILE, job_levels, prune_empty, rank_dir_name
from .owner import MAX_OWNER_BYTES, human_age, judge_owner, last_change, parse_owner

log = logging.getLogger(__name__)

MAX_SWEEP_ENTRIES = 4096
"""Entries the start-up sweep lists at most per directory where a template has a placeholder."""
_NAME = re.compile(re.escape(DIR_PREFIX) + r".+\.rank\d+\.pid\d+$")

# Verdicts of a scan.
STALE = "stale"  # dead owner: removed (or would be, with --dry-run)
LIVE = "live"  # owner running: never touched
UNKNOWN = "unknown"  # cannot tell (other host or container, foreign, malformed): left alone


# -- scanning ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Leftover:
    """One rank directory found under a root, and what the sweep makes of it."""

    path: str
    verdict: str  # STALE, LIVE or UNKNOWN
    reason: str
    owner: Optional[dict] = None
    nbytes: int = 0  # bytes its files occupy on disk
    removed: bool = False
    error: Optional[str] = None  # why removing a stale directory failed
    pruned: List[str] = dataclasses.field(default_factory=list)  # empty folders removed after it
    undecided: bool = False  # a valid record of ours whose owner's life cannot be told
    uid: Optional[int] = None  # who owns the directory (the job's user)
    changed: float = 0.0  # when anything in it last changed (for older_than)

    def describe(self) -> str:
        who = ""
        if self.owner:
            who = f"job {self.owner.get('job')}, rank {self.owner.get('rank')}, "
        return f"{self.path} ({who}{self.reason}; {human_bytes(self.nbytes)})"


def _open_owner(dir_fd: int) -> Tuple[int, dict]:
    """``owner.json`` in ``dir_fd``: its open descriptor (the caller closes it; the lock is
    asked for on it) and its record, checked (ValueError says what is wrong)."""
    fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{OWNER_FILE} is not a plain file")
        return fd, parse_owner(os.read(fd, MAX_OWNER_BYTES + 1))
    except BaseException:
        os.close(fd)
        raise


def _disk_bytes(dir_fd: int) -> int:
    total = 0
    for name in os.listdir(dir_fd):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_blocks * 512
    return total


def _judge(root_fd: int, root: str, name: str) -> Optional[Leftover]:
    """What the directory ``name`` under ``root`` is; None if it is not a rank directory name."""
    if _NAME.match(name) is None:
        return None
    path = os.path.join(root, name)
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None  # removed meanwhile (its owner closed, or another sweep)
    if not stat.S_ISDIR(st.st_mode):
        return Leftover(path, UNKNOWN, "not a directory (a symlink or file with our name): not ours")
    uid = os.getuid()
    if uid != 0 and st.st_uid != uid:
        return Leftover(path, UNKNOWN, f"owned by uid {st.st_uid}, not by us")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Leftover(path, UNKNOWN, f"cannot open it: {exc.strerror}")
    try:
        try:
            owner_fd, owner = _open_owner(fd)
        except FileNotFoundError:
            return Leftover(path, UNKNOWN, f"no {OWNER_FILE} (being created, or not ours)")
        except (OSError, ValueError) as exc:
            return Leftover(path, UNKNOWN, f"unreadable {OWNER_FILE}: {exc}")
        try:
            nbytes = _disk_bytes(fd)
            if name != rank_dir_name(owner["job"], owner["hostname"], owner["rank"], owner["pid"]):
                return Leftover(path, UNKNOWN, f"{OWNER_FILE} does not match the directory name", owner, nbytes)
            alive, why = judge_owner(owner, owner_fd, fd)
            changed = last_change(fd)
        except OSError as exc:  # one directory we cannot read does not stop the sweep of the rest
            return Leftover(path, UNKNOWN, f"cannot read it: {exc.strerror or exc}", owner)
        finally:
            os.close(owner_fd)
    finally:
        os.close(fd)
    verdict = LIVE if alive else STALE if alive is False else UNKNOWN
    return Leftover(path, verdict, why, owner, nbytes, undecided=alive is None, changed=changed, uid=st.st_uid)


def scan_root(root: str) -> List[Leftover]:
    """Every rank directory under ``root`` with its verdict (nothing is changed). The host
    that wrote one does not enter the verdict: its lock and boot id do (``owner.judge_owner``)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = []
        for name in sorted(os.listdir(root_fd)):
            if name.startswith(DIR_PREFIX):
                item = _judge(root_fd, root, name)
                if item is not None:
                    found.append(item)
        return found
    finally:
        os.close(root_fd)


def _remove(root: str, item: Leftover) -> None:
    """Remove a stale directory: its plain files, then the directory; nothing else."""
    name = os.path.basename(item.path)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        except FileNotFoundError:
            item.removed = True  # another sweep was first
            return
        try:
            entries = os.listdir(fd)
            for entry in entries:
                try:
                    mode = os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue  # another sweep (another rank starting) removed it first
                if not stat.S_ISREG(mode):
                    raise OSError(f"{os.path.join(item.path, entry)!r} is not a plain file; "
                                  "leaving the directory as it is")
            for entry in entries:
                try:
                    os.unlink(entry, dir_fd=fd)
                except FileNotFoundError:
                    pass
        finally:
            os.close(fd)
        try:
            os.rmdir(name, dir_fd=root_fd)
        except FileNotFoundError:
            pass
        item.removed = True
    finally:
        os.close(root_fd)


def _apply_age(found: List[Leftover], older_than: Optional[float]) -> None:
    """What no lock can tell (``undecided``) and nothing changed in for ``older_than`` seconds
    counts as dead: the explicit choice of ``ssdtrain clean --older-than``."""
    if older_than is None:
        return
    now = time.time()
    for item in found:
        if item.verdict == UNKNOWN and item.undecided and now - item.changed > older_than:
            item.verdict = STALE
            item.reason += f"; nothing changed in it for {human_age(now - item.changed)} (--older-than)"


def clean_root(root: str, dry_run: bool = False, older_than: Optional[float] = None) -> List[Leftover]:
    """Scan ``root`` and remove the directories of dead owners (none with ``dry_run``), and,
    with ``older_than`` (seconds), those whose owner's life cannot be told and in which nothing
    changed for that long.

    Raises OSError only when ``root`` itself cannot be read; a directory that cannot be
    removed is reported in its Leftover's ``error``."""
    found = scan_root(root)
    _apply_age(found, older_than)
    if not dry_run:
        for item in found:
            if item.verdict == STALE:
                try:
                    _remove(root, item)
                except OSError as exc:
                    item.error = exc.strerror or str(exc)
    return found


def _prune_after(found: List[Leftover], directory: str, levels: int) -> None:
    """Remove the folders ``found``'s removals left empty: ``directory`` and up to ``levels``
    directories in all; the removed ones are listed on the last removed Leftover."""
    removed = [item for item in found if item.removed]
    if removed and levels > 0:
        removed[-1].pruned.extend(prune_empty(directory, levels))


def _prune_job_folders(found: List[Leftover], directory: str, top: str) -> None:
    """After ``found``'s removals from ``directory`` (below ``top``): remove the folders their
    job made that they left empty, and no other. Below a bare ROOT no template says which
    folders a job made; these are: ``directory`` and its parents up to the nearest one named
    after the job id (the ``{job}`` folder of the documented layouts), each owned by the user
    who owns the rank directory, never a mount point, never ``top`` or above it. A folder
    someone else made (``/raid/alice``, an admin's ``/raid/<job>``), or any folder where the
    template had no ``{job}``, stays: `ssdtrain clean` run as root once removed other users'
    folders up to ROOT."""
    removed = [item for item in found if item.removed and item.owner is not None]
    if not removed:
        return
    item = removed[-1]
    parts = [] if directory == top else os.path.relpath(directory, top).split(os.sep)
    levels = min((len(parts) - i for i, part in enumerate(parts)
                  if any(part == r.owner["job"] for r in removed)), default=0)
    if not all(r.uid == item.uid for r in removed):
        return
    path = directory
    for _ in range(levels):
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != item.uid or os.path.ismount(path):
                return
            os.rmdir(path)
        except OSError:  # not empty (another job's directory), gone, or not ours to remove
            return
        item.pruned.append(path)
        path = os.path.dirname(path)


def clean_tree(top: str, dry_run: bool = False, older_than: Optional[float] = None) -> List[Leftover]:
    """:func:`clean_root` on ``top`` and on every directory below it (symlinks are not
    followed; rank directories are not entered), then remove the folders between ``top``
    (kept) and each removed directory that the removal left empty.

    Raises OSError only when ``top`` itself cannot be read; an unreadable folder below it is
    reported as an UNKNOWN Leftover."""
    top = os.path.abspath(top)
    found: List[Leftover] = []
    top_error: List[OSError] = []

    def unreadable(exc: OSError) -> None:
        if os.path.abspath(exc.filename or top) == top:
            top_error.append(exc)
        else:
            found.append(Leftover(exc.filename, UNKNOWN, f"cannot read it: {exc.strerror or exc}"))

    for dirpath, dirnames, _files in os.walk(top, onerror=unreadable):
        if any(_NAME.match(n) for n in dirnames):
            dirnames[:] = [n for n in dirnames if _NAME.match(n) is None]
            here = clean_root(dirpath, dry_run, older_than)
            found.extend(here)
            _prune_job_folders(here, dirpath, top)
        dirnames.sort()
    if top_error:
        raise top_error[0]
    return found


def template_roots(template: str, hostname: Optional[str] = None) -> List[str]:
    """The existing directories a ``dirs`` template names on this host, for any job, rank and
    local rank: each placeholder but ``{hostname}`` (this host) matches any name."""
    hostname = hostname or socket.gethostname()
    parts = []
    for component in os.path.abspath(os.path.expanduser(template)).split("/")[1:]:
        pattern = ""
        for literal, field, _spec, _conv in string.Formatter().parse(component):
            pattern += glob.escape(literal)
            if field is not None:
                pattern += glob.escape(hostname) if field == "hostname" else "*"
        parts.append(pattern)
    return sorted(p for p in glob.glob("/" + "/".join(parts)) if os.path.isdir(p) and not os.path.islink(p))


def bounded_template_roots(template: str, hostname: Optional[str] = None,
                           max_entries: int = MAX_SWEEP_ENTRIES) -> List[str]:
    """:func:`template_roots` for the start-up sweep, bounded so that a big shared filesystem
    does not slow a job's start: a literal component is looked up, never listed; a component
    with a placeholder lists its parent, at most ``max_entries`` entries of it, and follows
    only directories (no symlinks) that belong to the user running the sweep (root: any), so
    it never descends into other users' trees. ``ssdtrain clean`` looks everywhere."""
    hostname = hostname or socket.gethostname()
    uid = os.getuid()
    paths = ["/"]
    for component in os.path.abspath(os.path.expanduser(template)).split("/")[1:]:
        pieces = list(string.Formatter().parse(component))
        if all(field is None for _lit, field, _s, _c in pieces):
            paths = [os.path.join(p, component) for p in paths
                     if os.path.isdir(os.path.join(p, component))]
            continue
        pattern = "".join(glob.escape(lit) + ("" if field is None else glob.escape(hostname)
                                             if field == "hostname" else "*")
                          for lit, field, _s, _c in pieces)
        nxt = []
        for parent in paths:
            nxt.extend(_matching_dirs(parent, pattern, uid, max_entries))
        paths = nxt
    return sorted(p for p in paths if not os.path.islink(p))


def _matching_dirs(parent: str, pattern: str, uid: int, max_entries: int) -> List[str]:
    out = []
    try:
        with os.scandir(parent) as it:
            for n, entry in enumerate(it):
                if n >= max_entries:
                    log.warning("ssdtrain: the start-up sweep for leftovers stopped after %d entries of "
                                "%s; `ssdtrain clean --dirs ...` looks at all of them", max_entries, parent)
                    break
                if not fnmatch.fnmatchcase(entry.name, pattern) or not entry.is_dir(follow_symlinks=False):
                    continue
                if uid == 0 or entry.stat(follow_symlinks=False).st_uid == uid:
                    out.append(entry.path)
    except OSError:
        pass  # unreadable: nothing of ours can be swept there anyway
    return out


def clean_templates(templates: Sequence[str], dry_run: bool = False, hostname: Optional[str] = None,
                    bounded: bool = False, older_than: Optional[float] = None) -> List[Leftover]:
    """:func:`clean_root` on every directory ``templates`` name on this host
    (:func:`template_roots`, or :func:`bounded_template_roots` when ``bounded``), then remove
    the job folders (the template's components from its first ``{job}`` on) that the removals
    left empty."""
    found: List[Leftover] = []
    seen = set()
    for template in templates:
        roots = bounded_template_roots(template, hostname) if bounded else template_roots(template, hostname)
        for root in roots:
            if root in seen:
                continue
            seen.add(root)
            try:
                here = clean_root(root, dry_run, older_than)
            except OSError as exc:
                found.append(Leftover(root, UNKNOWN, f"cannot read it: {exc.strerror or exc}"))
                continue
            found.extend(here)
            _prune_after(here, root, job_levels(template))
    return found


def sweep_templates(templates: Sequence[str], hostname: Optional[str] = None) -> List[Leftover]:
    """Start-up sweep of everything ``templates`` name on this host: remove dead jobs'
    leftovers and the job folders they leave empty, log what happened, never raise."""
    try:
        found = clean_templates(templates, hostname=hostname, bounded=True)
    except OSError as exc:
        log.warning("ssdtrain: could not look for leftovers of dead jobs under %s: %s",
                    ", ".join(templates), exc.strerror or exc)
        return []
    _log_sweep(found)
    return found


def _log_sweep(found: List[Leftover]) -> None:
    for item in found:
        if item.removed:
            log.warning("ssdtrain: removed the leftovers of a dead job: %s", item.describe())
        elif item.error:
            log.warning("ssdtrain: could not remove the leftovers of a dead job %s: %s", item.describe(), item.error)


def remove_stale(root: str) -> List[Leftover]:
    """Start-up sweep of one root: remove dead jobs' leftovers, log what happened, never raise
    (a root we cannot sweep is still usable for our own directory)."""
    try:
        found = clean_root(root)
    except OSError as exc:
        log.warning("ssdtrain: could not look for leftovers of dead jobs in %s: %s", root, exc.strerror or exc)
        return []
    _log_sweep(found)
    return found


def sweep_before_start(roots: Sequence[str], templates: Optional[Sequence[str]] = None,
                       hostname: Optional[str] = None) -> List[Leftover]:
    """What a disk engine calls before it creates its rank directories: remove dead jobs'
    leftovers from every directory ``templates`` name on this host (any job, any rank), then
    from each of ``roots`` that exists (a root reached through a symlink is not among the
    templates' matches). Logs what happened, never raises."""
    found = sweep_templates(templates, hostname) if templates else []
    for root in roots:
        if os.path.isdir(root):
            found.extend(remove_stale(root))
    return found


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
