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
(``sweepfd.prune``; below a bare ROOT ``_prune_job_folders``), never a folder that was
empty before, a mount point, one above the first ``{job}`` component of a template, or, below
a ROOT, one above the folder named after the job id or owned by another user than the job's.

Every folder a sweep walks is held open from the one the user named down, each opened
relative to the one above without following a link, and a directory is judged and removed
through the same descriptor of its folder, after checking it still is the directory judged
(``sweepfd``: a folder swapped for a symlink between the two steers nothing). A sweep walks
only folders owned by the user it removes for or by root (root: the owner of the first
folder of somebody else's on the way), at most ``sweepfd.MAX_DEPTH`` levels deep, and says
in one line what it left out.

What counts as ours, and dead, is decided conservatively, because a mistake deletes a live
job's activations (it then fails at its next read) or someone else's files:
- only directories (never symlinks) whose name has our prefix, with a valid ``owner.json``
  (``owner.parse_owner``: size, nesting, every field's type and range; anything else is
  "unknown", never an error) whose host, rank and pid agree with the name, and owned by the
  user the sweep removes for (the user running it; root: the owner of the folders above);
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
import errno
import logging
import os
import re
import stat
import time
from typing import List, Optional, Sequence, Tuple

from .dirfd import DIR_FLAGS, remove_entry_dir
from .layout import DIR_PREFIX, OWNER_FILE, fixed_part, job_levels, rank_dir_name
from .owner import MAX_OWNER_BYTES, OpenFiles, human_age, judge_owner, last_change, orphaned_lock, parse_owner
from .template_roots import MAX_SWEEP_ENTRIES, bounded_template_roots, template_roots  # noqa: F401 (API)
from .sweepfd import MANY, Folder, Skips, close_all, open_path, open_top, owner_text, prune, sweeper, walk

log = logging.getLogger(__name__)

MAX_SWEEP_JUDGED = 1024
"""Rank directories the start-up sweep judges at most, in all its folders together: 20,000
planted in one folder, or a thousand in each of many, must not hold up every job's start
(``ssdtrain clean`` judges them all)."""
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
    ident: Optional[Tuple[int, int]] = None  # (device, inode) of the directory judged
    record: Optional[Tuple[int, int]] = None  # (device, inode) of its owner.json

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


def judge_entry(root_fd: int, root: str, name: str, for_uid: Optional[int]) -> Optional[Leftover]:
    """What the directory ``name`` in the folder ``root_fd`` (at ``root``) is, judged for the
    user ``for_uid`` (None: anyone's, root in root's folders); None if ``name`` is not a rank
    directory name or it is gone."""
    if _NAME.match(name) is None:
        return None
    path = os.path.join(root, name)
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None  # removed meanwhile (its owner closed, or another sweep)
    if not stat.S_ISDIR(st.st_mode):
        return Leftover(path, UNKNOWN, "not a directory (a symlink or file with our name): not ours")
    if for_uid is not None and st.st_uid != for_uid:
        return Leftover(path, UNKNOWN, owner_text(st.st_uid, for_uid))
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Leftover(path, UNKNOWN, f"cannot open it: {exc.strerror}")
    try:
        held = os.fstat(fd)
        if (held.st_dev, held.st_ino) != (st.st_dev, st.st_ino):
            return Leftover(path, UNKNOWN, "replaced while it was looked at: left alone")
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
            record = os.fstat(owner_fd)
        except OSError as exc:  # one directory we cannot read does not stop the sweep of the rest
            return Leftover(path, UNKNOWN, f"cannot read it: {exc.strerror or exc}", owner)
        finally:
            os.close(owner_fd)
    finally:
        os.close(fd)
    verdict = LIVE if alive else STALE if alive is False else UNKNOWN
    return Leftover(path, verdict, why, owner, nbytes, undecided=alive is None, changed=changed, uid=st.st_uid,
                    ident=(st.st_dev, st.st_ino), record=(record.st_dev, record.st_ino))


def scan_dir(dir_fd: int, path: str, for_uid: Optional[int], limit: Optional[int] = None,
             skips: Optional[Skips] = None) -> List[Leftover]:
    """Every rank directory in the folder held as ``dir_fd`` (at ``path``) with its verdict,
    judged for ``for_uid`` (:func:`judge_entry`); at most ``limit`` of them judged (the rest are
    counted in ``skips``). Nothing is changed. The host that wrote one does not enter the
    verdict: its lock and boot id do (``owner.judge_owner``)."""
    found = []
    judged = 0
    for name in sorted(os.listdir(dir_fd)):
        if _NAME.match(name) is None:
            continue
        if limit is not None and judged >= limit:
            if skips is not None:
                skips.add(MANY, os.path.join(path, name))
            continue
        judged += 1
        item = judge_entry(dir_fd, path, name, for_uid)
        if item is not None:
            found.append(item)
    return found


def between_judging_and_removing(item: Leftover) -> None:
    """Called after ``item`` was judged stale and before it is removed; does nothing. The seam
    where the tests put another user's move (a folder swapped for a symlink) at the worst
    moment, so that the race is played every time."""


def _remove_at(dir_fd: int, item: Leftover) -> None:
    """Remove the stale directory ``item`` from the folder held as ``dir_fd``: opened again
    relative to it without following a link, and only if it still is the directory judged
    (device and inode); its plain files, then the directory; nothing else."""
    name = os.path.basename(item.path)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        item.removed = True  # another sweep was first
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError("replaced by something else than a directory after it was judged; left alone") from None
        raise
    try:
        held = os.fstat(fd)
        if (held.st_dev, held.st_ino) != item.ident:
            raise OSError("replaced by another directory after it was judged; left alone")
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
        if not remove_entry_dir(dir_fd, name, fd):
            try:
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass  # another sweep was first
            else:
                raise OSError("it could not be removed (something was added to it, or it was replaced)")
    finally:
        os.close(fd)
    item.removed = True


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


def clean_dir(dir_fd: int, path: str, for_uid: Optional[int], dry_run: bool = False,
              older_than: Optional[float] = None, limit: Optional[int] = None,
              skips: Optional[Skips] = None) -> List[Leftover]:
    """:func:`scan_dir` the folder held as ``dir_fd`` and remove the directories of dead
    owners through that same descriptor (none with ``dry_run``), and, with ``older_than``
    (seconds), those whose owner's life cannot be told and in which nothing changed for that
    long. A directory that cannot be removed is reported in its Leftover's ``error``."""
    found = scan_dir(dir_fd, path, for_uid, limit, skips)
    _apply_age(found, older_than)
    if not dry_run:
        for item in found:
            if item.verdict == STALE:
                between_judging_and_removing(item)
                try:
                    _remove_at(dir_fd, item)
                except OSError as exc:
                    item.error = exc.strerror or str(exc)
    return found


def clean_root(root: str, dry_run: bool = False, older_than: Optional[float] = None,
               skips: Optional[Skips] = None, limit: Optional[int] = None) -> List[Leftover]:
    """:func:`clean_dir` on the folder ``root`` (opened once, by path); nothing when it is
    another user's (counted in ``skips``).

    Raises OSError only when ``root`` itself cannot be read."""
    skips = Skips() if skips is None else skips
    top = open_top(root, skips)
    if top is None:
        return []
    try:
        return clean_dir(top.fd, root, top.for_uid, dry_run, older_than, limit, skips)
    finally:
        top.close()


def scan_root(root: str) -> List[Leftover]:
    """Every rank directory in ``root`` with its verdict (nothing is changed)."""
    return clean_root(root, dry_run=True)


def _prune_job_folders(found: List[Leftover], chain: List[Folder]) -> None:
    """After ``found``'s removals from the last folder of ``chain`` (held from the ROOT down):
    remove the folders their job made that they left empty, and no other. Below a bare ROOT no
    template says which folders a job made; these are: the last folder and its parents up to
    the nearest one named after the job id (the ``{job}`` folder of the documented layouts),
    each owned by the user who owns the rank directory, never a mount point, never the ROOT.
    A folder someone else made (``/raid/alice``, an admin's ``/raid/<job>``), or any folder
    where the template had no ``{job}``, stays: `ssdtrain clean` run as root once removed other
    users' folders up to ROOT."""
    removed = [item for item in found if item.removed and item.owner is not None]
    if not removed or not all(r.uid == removed[-1].uid for r in removed):
        return
    jobs = {r.owner["job"] for r in removed}
    names = [folder.name for folder in chain[1:]]
    levels = min((len(names) - i for i, part in enumerate(names) if part in jobs), default=0)
    removed[-1].pruned.extend(prune(chain, levels, removed[-1].uid))


def clean_tree(top: str, dry_run: bool = False, older_than: Optional[float] = None,
               skips: Optional[Skips] = None) -> List[Leftover]:
    """:func:`clean_dir` on ``top`` and on every folder below it that the sweep may walk
    (``sweepfd``: held descriptors, no link followed, the owner rule, at most MAX_DEPTH levels;
    rank directories are not entered), then remove the folders between ``top`` (kept) and
    each removed directory that the removal left empty. What was left out is counted in
    ``skips``.

    Raises OSError only when ``top`` itself cannot be read; an unreadable folder below it is
    reported as an UNKNOWN Leftover."""
    top = os.path.abspath(top)
    skips = Skips() if skips is None else skips
    found: List[Leftover] = []

    def unreadable(path: str, exc: OSError) -> None:
        found.append(Leftover(path, UNKNOWN, f"cannot read it: {exc.strerror or exc}"))

    first = open_top(top, skips)
    if first is None:
        return found
    for chain in walk(first, lambda n: _NAME.match(n) is not None, skips, unreadable):
        here = chain[-1]
        try:
            got = clean_dir(here.fd, here.path, here.for_uid, dry_run, older_than, skips=skips)
        except OSError as exc:
            unreadable(here.path, exc)
            continue
        found.extend(got)
        _prune_job_folders(got, chain)
    return found


def clean_templates(templates: Sequence[str], dry_run: bool = False, hostname: Optional[str] = None,
                    bounded: bool = False, older_than: Optional[float] = None,
                    skips: Optional[Skips] = None) -> List[Leftover]:
    """:func:`clean_dir` on every directory ``templates`` name on this host
    (:func:`template_roots`, or :func:`bounded_template_roots` when ``bounded``: then at most
    MAX_SWEEP_JUDGED rank directories judged in all), each reached from the template's fixed
    part through held descriptors without following a link (``sweepfd.open_path``), then
    remove the job folders (the template's components from its first ``{job}`` on) that the
    removals left empty, through the same descriptors. What was left out is counted in
    ``skips``."""
    skips = Skips() if skips is None else skips
    found: List[Leftover] = []
    seen = set()
    judged = 0
    for template in templates:
        roots = bounded_template_roots(template, hostname) if bounded else template_roots(template, hostname)
        base = fixed_part(template)
        for root in roots:
            if root in seen:
                continue
            seen.add(root)
            try:
                chain = open_path(base, root, skips)
            except OSError as exc:
                found.append(Leftover(root, UNKNOWN, f"cannot read it: {exc.strerror or exc}"))
                continue
            if chain is None:
                continue
            try:
                left = max(0, MAX_SWEEP_JUDGED - judged) if bounded else None
                here = clean_dir(chain[-1].fd, root, chain[-1].for_uid, dry_run, older_than, left, skips)
                judged += len(here)
                found.extend(here)
                removed = [item for item in here if item.removed]
                if removed:
                    removed[-1].pruned.extend(prune(chain, job_levels(template), sweeper()))
            except OSError as exc:
                found.append(Leftover(root, UNKNOWN, f"cannot read it: {exc.strerror or exc}"))
            finally:
                close_all(chain)
    return found


def sweep_templates(templates: Sequence[str], hostname: Optional[str] = None,
                    skips: Optional[Skips] = None) -> List[Leftover]:
    """Start-up sweep of everything ``templates`` name on this host: remove dead jobs'
    leftovers and the job folders they leave empty, log what happened, never raise."""
    try:
        found = clean_templates(templates, hostname=hostname, bounded=True, skips=skips)
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


def remove_stale(root: str, skips: Optional[Skips] = None, limit: Optional[int] = None) -> List[Leftover]:
    """Start-up sweep of one root: remove dead jobs' leftovers (at most ``limit`` judged,
    MAX_SWEEP_JUDGED by default), log what happened, never raise (a root we cannot sweep is still usable for our
    own directory)."""
    try:
        found = clean_root(root, skips=skips, limit=MAX_SWEEP_JUDGED if limit is None else limit)
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
    templates' matches). Logs what happened (what it left out: one line, at info), never
    raises."""
    skips = Skips()
    found = sweep_templates(templates, hostname, skips) if templates else []
    for root in roots:
        if os.path.isdir(root):
            found.extend(remove_stale(root, skips, max(0, MAX_SWEEP_JUDGED - len(found))))
    line = skips.line()
    if line:
        log.info("ssdtrain: the start-up sweep for dead jobs' leftovers %s", line)
    return found


def held_by(item: Leftover, open_files: OpenFiles) -> Optional[str]:
    """For a live directory whose lock outlived the process that wrote its record (a child it
    forked from C kept the lock): which processes hold it (``owner.orphaned_lock``); else None."""
    if item.verdict != LIVE or item.owner is None or item.record is None:
        return None
    return orphaned_lock(item.owner, item.record, open_files)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
