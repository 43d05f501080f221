"""Who a process is, for the ``owner.json`` of its rank directories, and whether it still runs.

A pid alone does not name a process for good: pids are reused, and mean something only inside
one pid namespace and one boot. ``owner_record`` writes down enough to tell (boot id, pid
namespace, start time in clock ticks); ``owner_alive`` reads it back. ``layout`` writes the
record when it creates a rank directory; ``clean`` reads it when it sweeps leftovers.
"""

from __future__ import annotations

import os
import time
from typing import Optional, Tuple


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
