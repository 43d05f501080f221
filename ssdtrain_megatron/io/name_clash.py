"""A second pod with this job's id: say so before the rank directory is refused.

A rank directory is named ``ssdtrain.<job>.<host>.rank<r>.pid<pid>``. Pods often have fixed host
names and their first process has the same pid in each pid namespace (1, or the same small
number), so two pods started with the same job id on a drive they share want the same name.
Without this check the second one was refused with "another offloader of this process uses
the same root", which is not what happened.
"""

from __future__ import annotations

import os
from typing import Sequence

from .clean import LIVE, STALE, judge_entry
from .dirfd import LayoutError
from .layout import Identity, rank_dir_name
from .owner import holds_record


def check_own_names(roots: Sequence[str], ident: Identity) -> None:
    """Raise LayoutError when a directory with the name this process is about to make
    (``ssdtrain.<job>.<host>.rank<r>.pid<pid>``) is in one of ``roots`` after the sweep and
    is not this process's own (another offloader of this process says so itself, later): a
    process with the same job id, host name, rank and pid made it. Pids repeat across pid
    namespaces and pods often have fixed host names, so that is a second pod or container
    started with the same job id; the line says so, and what to change."""
    name = rank_dir_name(ident.job, ident.hostname, ident.rank, os.getpid())
    for root in roots:
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # making the directory there says what is wrong
        try:
            item = judge_entry(root_fd, root, name, None)
        finally:
            os.close(root_fd)
        if item is None or item.verdict == STALE or item.owner is None or holds_record(item.record):
            continue
        if item.verdict == LIVE:
            what = f"a running process ({item.reason})"
            fix = ""
        else:
            what = f"a process whose life cannot be told from here ({item.reason})"
            fix = f"; if that job is gone, `ssdtrain clean --older-than 1h {root}` removes it"
        raise LayoutError(
            f"{item.path} was made by {what} with this job's id {ident.job!r}, host name "
            f"{ident.hostname!r}, rank {ident.rank} and pid {os.getpid()}: a second pod or container "
            f"(pids repeat across pid namespaces, pods often share a host name) was started with the "
            f"same job id on a drive this one shares. Give each run its own job id (--ssd-offload-job, "
            f"OffloadConfig.job) or its own dirs{fix}")
