"""What the drive rows measure (no torch: the parent's and the steps'): the filesystem of the
scratch folder and whether it takes O_DIRECT.

The posix engine falls back to buffered IO where O_DIRECT is refused (io/slab.py, a log line
only), and tmpfs is memory: either way its rows would time the page cache, not a drive. So the
run probes the folder it offloads to, records what it found beside the results, and the rows
that judge the drive are NOT RUN, with this reason, where it is not a drive taking O_DIRECT.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from typing import Dict, List, Optional

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
PROBE_NAME = ".o_direct_probe"
PROBE_BYTES = 4096  # one page: the largest direct-IO granularity the engine probes for (io/bounce.py)
RAW_NAME = ".raw_rate"
RAW_CHUNK = 8 << 20
RAW_THREADS = 4
RAW_MAX_BYTES = 512 << 20
"""The raw rate's bytes at most each way (the plan's estimate counts them)."""


def filesystem(path: str, mountinfo: str = "/proc/self/mountinfo") -> Dict[str, str]:
    """The mount holding ``path`` (the longest mount point above its real path): {"type",
    "mount", "source"}; "unknown" where /proc is not readable."""
    real = os.path.realpath(path)
    best = {"type": "unknown", "mount": "", "source": ""}
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best["mount"]):
            best = {"type": tail[0], "mount": mount, "source": tail[1]}
    return best


def o_direct_error(directory: str) -> Optional[str]:
    """None when a page-aligned page can be written and read back with O_DIRECT in
    ``directory``; else what refused it."""
    path = os.path.join(directory, PROBE_NAME)
    buf = mmap.mmap(-1, PROBE_BYTES)  # page-aligned, as the engine's buffers are
    buf.write(b"\x5a" * PROBE_BYTES)
    fd = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
        if os.pwritev(fd, [buf], 0) != PROBE_BYTES or os.preadv(fd, [buf], 0) != PROBE_BYTES:
            return "a short O_DIRECT write or read"
        return None
    except OSError as exc:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        return f"O_DIRECT refused ({name}: {exc.strerror})"
    finally:
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        buf.close()


def probe(directory: str) -> Dict[str, object]:
    """{"dir", "filesystem", "mount", "source", "o_direct", "o_direct_error", "problem"}:
    ``problem`` is why the drive rows cannot judge a drive here, or ""."""
    os.makedirs(directory, exist_ok=True)
    fs = filesystem(directory)
    err = o_direct_error(directory)
    problem = ""
    if fs["type"] in MEMORY_FILESYSTEMS:
        problem = (f"scratch {directory} is on {fs['type']} (memory, mounted at {fs['mount']}): the posix rows would "
                   f"time the page cache; give --scratch a directory on the drive")
    elif err:
        problem = (f"scratch {directory} ({fs['type']} at {fs['mount']}): {err}, so posix falls back to buffered IO "
                   f"and its rows would time the page cache; give --scratch a directory on a local drive")
    return {"dir": directory, "filesystem": fs["type"], "mount": fs["mount"], "source": fs["source"],
            "o_direct": err is None, "o_direct_error": err, "problem": problem}


def raw_rates(directory: str, nbytes: int) -> Dict[str, float]:
    """The drive's own rate, apart from the engine (as io-bench measures it): ``nbytes`` (at
    most RAW_MAX_BYTES, whole RAW_CHUNKs) written with O_DIRECT by RAW_THREADS threads at
    disjoint offsets of one file, fsync'd, then read back: {"write", "read"} bytes per second,
    "bytes". OSError where O_DIRECT is refused (the drive rows are NOT RUN then anyway)."""
    chunks = max(RAW_THREADS, min(int(nbytes), RAW_MAX_BYTES) // RAW_CHUNK)
    path = os.path.join(directory, RAW_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        os.ftruncate(fd, chunks * RAW_CHUNK)
        seconds = {}
        for op in ("write", "read"):
            t0 = time.perf_counter()
            _in_threads(fd, op, chunks)
            if op == "write":
                os.fsync(fd)
            seconds[op] = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    n = chunks * RAW_CHUNK
    return {"write": n / seconds["write"], "read": n / seconds["read"], "bytes": n}


def _in_threads(fd: int, op: str, chunks: int) -> None:
    errors: List[BaseException] = []

    def work(first: int) -> None:
        buf = mmap.mmap(-1, RAW_CHUNK)  # page-aligned, as O_DIRECT needs
        try:
            for i in range(first, chunks, RAW_THREADS):
                done = (os.pwritev if op == "write" else os.preadv)(fd, [buf], i * RAW_CHUNK)
                if done != RAW_CHUNK:
                    raise OSError(errno.EIO, f"a short O_DIRECT {op}: {done} of {RAW_CHUNK} bytes")
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(exc)
        finally:
            buf.close()

    threads = [threading.Thread(target=work, args=(t,), name=f"raw-{op}-{t}") for t in range(RAW_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def text(p: Dict[str, object]) -> str:
    """One line: where the drive rows' bytes go."""
    head = f"scratch {p['dir']}: {p['filesystem']} at {p['mount']} ({p['source']}), O_DIRECT " + \
        ("works" if p["o_direct"] else f"refused: {p['o_direct_error']}")
    return head + (f"; the drive rows will be NOT RUN: {p['problem']}" if p["problem"] else "")
