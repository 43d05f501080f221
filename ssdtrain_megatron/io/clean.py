"""Leftovers of dead jobs: find them under offload roots and remove them (``ssdtrain clean``).

A rank directory, ``ssdtrain.<job>.<host>.rank<r>.pid<pid>``, belongs to the process named in
its ``owner.json``. Normal exit and SIGINT/SIGTERM remove it (see cleanup.py); SIGKILL, a crash
of the interpreter or a node reset leave it behind. Every new offloader sweeps every directory
its ``dirs`` templates name on this host, for any job and rank (``sweep_templates``: a job
whose roots hold ``{job}`` finds the leftovers of other job ids too), and ``ssdtrain clean``
does the same on demand: below a ROOT at any depth (``clean_tree``), or from the templates of a
preset (``--config``) or of ``--dirs``. A sweep then removes the job folders it left empty
(``layout.prune_empty``), never a folder that was empty before, a mount point, or one above the
first ``{job}`` component of a template (or above ROOT).

What counts as ours, and dead, is decided conservatively, because a mistake deletes a live
job's activations (it then fails at its next read) or someone else's files:
- only directories (never symlinks) whose name has our prefix, with a readable ``owner.json``
  whose host, rank and pid agree with the name, and owned by the user running the sweep
  (root may sweep anyone's);
- dead means: written on this host, and the boot id changed (the node rebooted), or no
  process has that pid, or the process that has it started at another time (pid reused);
- written on another host, or in another pid namespace (another container sharing the
  drive), or without the fields to tell: left alone and reported;
- inside, only plain files are removed, through directory file descriptors opened without
  following links; anything else (a subdirectory, a symlink, a socket) keeps the whole
  directory in place and is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import re
import socket
import stat
import string
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .layout import DIR_PREFIX, OWNER_FILE, job_levels, prune_empty, rank_dir_name

log = logging.getLogger(__name__)

MAX_OWNER_BYTES = 64 * 1024
_NAME = re.compile(re.escape(DIR_PREFIX) + r".+\.rank\d+\.pid\d+$")

# Verdicts of a scan.
STALE = "stale"  # dead owner: removed (or would be, with --dry-run)
LIVE = "live"  # owner running: never touched
UNKNOWN = "unknown"  # cannot tell (other host or container, foreign, malformed): left alone


# -- who a process is -------------------------------------------------------------------------


def boot_id() -> Optional[str]:
    """This boot of this node (Linux), or None where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
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
    """What ``owner.json`` says about the process creating a rank directory now."""
    pid = os.getpid()
    return {"pid": pid, "hostname": hostname, "job": job, "rank": rank, "started": time.time(),
            "uid": os.getuid(), "boot_id": boot_id(), "pid_ns": pid_namespace(),
            "start_ticks": process_start_ticks(pid)}


def owner_alive(owner: dict) -> Tuple[Optional[bool], str]:
    """(True, why) if the owner runs, (False, why) if it is gone, (None, why) if we cannot tell.

    Call only for owners on this host."""
    pid = owner["pid"]
    recorded_boot = owner.get("boot_id")
    now_boot = boot_id()
    if recorded_boot and now_boot and recorded_boot != now_boot:
        return False, f"pid {pid} ran before the node last booted"
    ns = owner.get("pid_ns")
    if ns and ns != pid_namespace():
        return None, f"written from another pid namespace ({ns}, a container?); cannot tell whether pid {pid} runs"
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

    def describe(self) -> str:
        who = ""
        if self.owner:
            who = f"job {self.owner.get('job')}, rank {self.owner.get('rank')}, "
        return f"{self.path} ({who}{self.reason}; {_human(self.nbytes)})"


def _read_owner(dir_fd: int) -> dict:
    fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{OWNER_FILE} is not a plain file")
        data = os.read(fd, MAX_OWNER_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_OWNER_BYTES:
        raise ValueError(f"{OWNER_FILE} is larger than {MAX_OWNER_BYTES} bytes")
    owner = json.loads(data.decode("utf-8"))
    if not isinstance(owner, dict):
        raise ValueError(f"{OWNER_FILE} is not a JSON object")
    for key, kind in (("pid", int), ("hostname", str), ("rank", int), ("job", str)):
        if not isinstance(owner.get(key), kind) or isinstance(owner.get(key), bool):
            raise ValueError(f"{OWNER_FILE} has no valid {key!r}")
    if owner["pid"] <= 0:
        raise ValueError(f"{OWNER_FILE} has pid {owner['pid']}")
    return owner


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


def _judge(root_fd: int, root: str, name: str, hostname: str) -> Optional[Leftover]:
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
            owner = _read_owner(fd)
        except FileNotFoundError:
            return Leftover(path, UNKNOWN, f"no {OWNER_FILE} (being created, or not ours)")
        except (OSError, ValueError) as exc:
            return Leftover(path, UNKNOWN, f"unreadable {OWNER_FILE}: {exc}")
        nbytes = _disk_bytes(fd)
    finally:
        os.close(fd)
    if name != rank_dir_name(owner["job"], owner["hostname"], owner["rank"], owner["pid"]):
        return Leftover(path, UNKNOWN, f"{OWNER_FILE} does not match the directory name", owner, nbytes)
    if owner["hostname"] != hostname:
        return Leftover(path, UNKNOWN, f"written on host {owner['hostname']}, not this one", owner, nbytes)
    alive, why = owner_alive(owner)
    verdict = LIVE if alive else STALE if alive is False else UNKNOWN
    return Leftover(path, verdict, why, owner, nbytes)


def scan_root(root: str, hostname: Optional[str] = None) -> List[Leftover]:
    """Every rank directory under ``root`` with its verdict (nothing is changed)."""
    hostname = hostname or socket.gethostname()
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = []
        for name in sorted(os.listdir(root_fd)):
            if name.startswith(DIR_PREFIX):
                item = _judge(root_fd, root, name, hostname)
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


def clean_root(root: str, dry_run: bool = False, hostname: Optional[str] = None) -> List[Leftover]:
    """Scan ``root`` and remove the directories of dead owners (none with ``dry_run``).

    Raises OSError only when ``root`` itself cannot be read; a directory that cannot be
    removed is reported in its Leftover's ``error``."""
    found = scan_root(root, hostname)
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


def clean_tree(top: str, dry_run: bool = False, hostname: Optional[str] = None) -> List[Leftover]:
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
            here = clean_root(dirpath, dry_run, hostname)
            found.extend(here)
            depth = 0 if dirpath == top else len(os.path.relpath(dirpath, top).split(os.sep))
            _prune_after(here, dirpath, depth)
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


def clean_templates(templates: Sequence[str], dry_run: bool = False,
                    hostname: Optional[str] = None) -> List[Leftover]:
    """:func:`clean_root` on every directory ``templates`` name on this host
    (:func:`template_roots`), then remove the job folders (the template's components from its
    first ``{job}`` on) that the removals left empty."""
    found: List[Leftover] = []
    seen = set()
    for template in templates:
        for root in template_roots(template, hostname):
            if root in seen:
                continue
            seen.add(root)
            try:
                here = clean_root(root, dry_run, hostname)
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
        found = clean_templates(templates, hostname=hostname)
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


def remove_stale(root: str, hostname: Optional[str] = None) -> List[Leftover]:
    """Start-up sweep of one root: remove dead jobs' leftovers, log what happened, never raise
    (a root we cannot sweep is still usable for our own directory)."""
    try:
        found = clean_root(root, hostname=hostname)
    except OSError as exc:
        log.warning("ssdtrain: could not look for leftovers of dead jobs in %s: %s", root, exc.strerror or exc)
        return []
    _log_sweep(found)
    return found


# -- the command ------------------------------------------------------------------------------


def add_clean_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``ssdtrain clean [--dry-run] [--config PRESET] [--dirs TEMPLATES] [ROOT...]``."""
    p = subparsers.add_parser(
        "clean", help="remove offload files left by jobs whose process is gone",
        description="Remove the rank directories (ssdtrain.<job>.<host>.rank<r>.pid<pid>) that dead "
                    "processes left: below each ROOT at any depth (e.g. the drive or the folder "
                    "above the job ids), or in every directory the offload path templates of a "
                    "preset (--config) or of --dirs name on this host, for any job id and rank. "
                    "The folders a removal leaves empty are removed too, up to ROOT (kept), or "
                    "from a template's first {job} component on. Directories of running "
                    "processes, of other hosts or containers, and anything we did not create are "
                    "left alone. The exit code is 1 when a root could not be read or a stale "
                    "directory could not be removed.")
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument("--config", metavar="PRESET",
                   help="a YAML preset (configs/*.yaml) or config file: clean where its offload "
                        "dirs templates point on this host")
    p.add_argument("--dirs", metavar="TEMPLATES",
                   help="offload path templates, comma-separated as for --ssd-offload-dir "
                        "(e.g. '/mnt/nvme{local_rank}/ssdtrain/{job}'): clean where they point "
                        "on this host")
    p.add_argument("roots", nargs="*", metavar="ROOT",
                   help="a folder holding offload directories at any depth (a drive, an offload "
                        "root, the folder above the job ids), or a template from OffloadConfig.dirs "
                        "({job}, {rank}, ... match any directory there)")
    p.set_defaults(func=run_clean)
    return p


def run_clean(args: argparse.Namespace) -> int:
    """Print one line per rank directory found; returns the exit code."""
    templates: List[str] = []
    if getattr(args, "config", None):
        from ..config import ConfigError, OffloadConfig

        try:
            templates += OffloadConfig.from_yaml(args.config).dirs
        except (OSError, ConfigError) as exc:
            print(f"ssdtrain clean: --config {args.config}: {getattr(exc, 'strerror', None) or exc}",
                  file=sys.stderr)
            return 2
    if getattr(args, "dirs", None):
        templates += [t for t in args.dirs.split(",") if t]
    if not args.roots and not templates:
        print("ssdtrain clean: name at least one ROOT, or --config PRESET, or --dirs TEMPLATES",
              file=sys.stderr)
        return 2
    status = 0
    totals: Dict[str, int] = {"dirs": 0, "bytes": 0, "folders": 0}
    # A ROOT written as a template (/mnt/nvme0/ssdtrain/{job}, as in the config) names every
    # directory it matches on this host.
    batches: List[Tuple[str, object]] = []
    for root in args.roots:
        if "{" not in root:
            batches.append((root, None))
        elif template_roots(root):
            templates.append(root)
        else:
            print(f"ssdtrain clean: {root}: no directory matches", file=sys.stderr)
    if templates:
        batches.append((", ".join(templates), templates))
    for name, batch_templates in batches:
        try:
            if batch_templates is None:
                found = clean_tree(name, dry_run=args.dry_run)
            else:
                found = clean_templates(batch_templates, dry_run=args.dry_run)
        except OSError as exc:
            print(f"ssdtrain clean: {name}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
            continue
        for item in found:
            if item.verdict == STALE:
                if item.error:
                    print(f"failed   {item.describe()}: {item.error}")
                    status = 1
                    continue
                print(f"{'would remove' if args.dry_run else 'removed':<8} {item.describe()}")
                totals["dirs"] += 1
                totals["bytes"] += item.nbytes
                for folder in item.pruned:
                    print(f"removed  {folder} (empty job folder)")
                    totals["folders"] += 1
            elif item.verdict == LIVE:
                print(f"live     {item.describe()}")
            else:
                print(f"skipped  {item.describe()}")
    verb = "would free" if args.dry_run else "freed"
    folders = f", {totals['folders']} empty folder{'' if totals['folders'] == 1 else 's'} removed" \
        if totals["folders"] else ""
    print(f"{totals['dirs']} stale director{'y' if totals['dirs'] == 1 else 'ies'}, {verb} "
          f"{_human(totals['bytes'])}{folders}")
    return status


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ssdtrain_megatron.io.clean``: the same command without the ``ssdtrain`` entry point."""
    parser = argparse.ArgumentParser(prog="ssdtrain")
    add_clean_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["clean", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
