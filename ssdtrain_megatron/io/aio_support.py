"""Whether DeepSpeed's DeepNVMe (the 'aio' engine) can run here, and loading it.

Everything here runs before any DeepNVMe handle exists, because the library reports none of
these problems itself: it asserts (aborting the process) or fails silently instead.
- :func:`aio_unavailable_reason` only looks for files and programs (DeepSpeed, libaio headers
  and library, a C++ compiler, ninja, Python headers): it neither imports DeepSpeed nor starts
  the JIT build, so config validation and ``is_available()`` stay cheap.
- :func:`load_aio_op` imports and, on first use on a machine, builds the op (minutes, cached
  under ``TORCH_EXTENSIONS_DIR``). torch serialises builds with a lock file that a killed
  build leaves behind, after which every load waits forever: a lock whose directory has been
  idle for ``STALE_BUILD_S`` is refused with the command that removes it.
- :func:`can_lock` and :func:`check_aio_events` check the memlock limit and ``fs.aio-max-nr``,
  which DeepNVMe would otherwise meet with an ``assert``.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import logging
import os
import resource
import shlex
import shutil
import sys
import sysconfig
import threading
import time
from typing import List, Optional, Tuple

import torch

from .base import EngineError, EngineUnavailable

log = logging.getLogger(__name__)

CAP_IPC_LOCK = 14


# -- capability checks (cheap: look for files, import nothing) ------------------------------


def _flag_dirs(var: str, flag: str) -> List[str]:
    return [a[len(flag):] for a in shlex.split(os.environ.get(var, "")) if a.startswith(flag)]


def _has_libaio_dev() -> bool:
    """libaio.h and the unversioned libaio.so the linker needs (both come with libaio-dev)."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    inc = ["/usr/include", "/usr/local/include"] + _flag_dirs("CFLAGS", "-I") \
        + [d for v in ("CPATH", "C_INCLUDE_PATH") for d in os.environ.get(v, "").split(":") if d]
    lib = [f"/usr/lib/{multiarch}", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/lib64",
           f"/lib/{multiarch}"] + _flag_dirs("LDFLAGS", "-L") \
        + [d for d in os.environ.get("LIBRARY_PATH", "").split(":") if d]
    has_header = any(os.path.exists(os.path.join(d, "libaio.h")) for d in inc)
    has_lib = any(glob.glob(os.path.join(d, "libaio.so")) or glob.glob(os.path.join(d, "libaio.a"))
                  for d in lib)
    return has_header and has_lib


def _prebuilt_op(ds_dir: str) -> bool:
    """DeepSpeed installed with DS_BUILD_AIO=1 ships the op; no build tools are needed."""
    return bool(glob.glob(os.path.join(ds_dir, "ops", "aio", "async_io_op*.so")))


def aio_unavailable_reason() -> str:
    """'' when the aio engine can run (or be built) here, else what is missing and how to get it.

    Only looks for files and programs: it neither imports DeepSpeed nor starts the build.
    """
    if not sys.platform.startswith("linux"):
        return "libaio exists only on Linux; use engine='posix'"
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return ("DeepSpeed is not installed: pip install deepspeed==0.19.8 (check first with "
                "`pip install --dry-run` that it leaves torch alone, or use --no-deps and add "
                "hjson msgpack ninja psutil py-cpuinfo pydantic tqdm einops)")
    if _prebuilt_op(list(spec.submodule_search_locations)[0]):
        return ""
    missing = []
    if not _has_libaio_dev():
        missing.append("libaio headers and library (apt-get install libaio-dev, or yum install "
                       "libaio-devel; set CFLAGS=-I... LDFLAGS=-L... for a private install)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        missing.append(f"a C++ compiler ({cxx!r} is not on PATH; apt-get install build-essential)")
    if shutil.which("ninja") is None:
        missing.append("ninja on PATH (pip install ninja, then put the environment's bin/ on PATH)")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        missing.append("the Python headers (apt-get install python3-dev)")
    if torch.version.cuda is not None and torch.cuda.is_available():
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            missing.append("the CUDA toolkit (DeepSpeed builds the op against it; set CUDA_HOME)")
    if missing:
        return ("DeepSpeed's async_io op is not built and cannot be built here; missing: "
                + "; ".join(missing))
    return ""


def load_aio_op():
    """Import (building on first use, for minutes) DeepSpeed's async_io op; returns the module.

    The build is cached under $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), and a
    file lock there makes concurrent ranks wait for one build instead of racing.
    """
    why = aio_unavailable_reason()
    if why:
        raise EngineUnavailable(f"engine 'aio' cannot run here: {why}")
    log.info("loading DeepSpeed's async_io op (the first use on a machine compiles it: minutes)")
    lock = build_lock_path()
    check_build_lock(lock)
    from deepspeed.ops.op_builder import AsyncIOBuilder  # imports deepspeed: only here

    done = threading.Event()
    watch = threading.Thread(target=_watch_build_lock, args=(lock, done), daemon=True)
    watch.start()
    try:
        # DeepSpeed keeps the loaded op per process, and checks the compiler and libaio (by
        # compiling a test program) only before the first load.
        with _stderr_with_fd():
            return AsyncIOBuilder().load(verbose=False)
    except Exception as exc:
        raise EngineUnavailable(f"engine 'aio' cannot run here: loading DeepSpeed's async_io op "
                                f"failed: {exc}") from exc
    finally:
        done.set()


# -- torch's build lock: a killed build leaves it behind, and every later load waits forever ---

STALE_BUILD_S = 600.0  # no file of the build directory touched for this long: nobody is building


def build_lock_path(name: str = "async_io") -> Optional[str]:
    """The lock file torch's JIT build of ``name`` takes (None if torch's layout is unknown)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return os.path.join(_get_build_directory(name, False), "lock")
    except Exception:  # noqa: BLE001 - a private torch helper; without it, no check
        return None


def _idle_seconds(directory: str) -> float:
    """Seconds since anything in ``directory`` (the build's objects, logs, the lock) changed."""
    newest = os.stat(directory).st_mtime
    for entry in os.scandir(directory):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
    return time.time() - newest


def _stale_text(lock: str, idle: float) -> str:
    return (f"torch's build lock {lock} is held but nothing in its directory has changed for "
            f"{idle / 60:.0f} min: a build of DeepSpeed's aio op was killed and left it behind, "
            f"and every load waits for it forever. If no process is building it, remove it "
            f"(rm {shlex.quote(lock)}) and retry")


def check_build_lock(lock: Optional[str], stale_s: float = STALE_BUILD_S) -> None:
    """Refuse to wait on a lock no build holds any more; say so when another build runs.

    Raises:
        EngineUnavailable: the lock exists and its directory has been idle for ``stale_s``.
    """
    if lock is None or not os.path.exists(lock):
        return
    idle = _idle_seconds(os.path.dirname(lock))
    if idle >= stale_s:
        raise EngineUnavailable(f"engine 'aio' cannot start: {_stale_text(lock, idle)}")
    log.warning("another process is building DeepSpeed's aio op (lock %s); waiting for it", lock)


def _watch_build_lock(lock: Optional[str], done: threading.Event, every_s: float = 60.0) -> None:
    """While a load waits, say once a minute if the lock it waits on has gone stale."""
    while lock is not None and not done.wait(every_s):
        try:
            if os.path.exists(lock):
                idle = _idle_seconds(os.path.dirname(lock))
                if idle >= STALE_BUILD_S:
                    log.error("ssdtrain: still waiting: %s", _stale_text(lock, idle))
        except OSError:
            continue


@contextlib.contextmanager
def _stderr_with_fd():
    """DeepSpeed's compatibility check redirects ``sys.stderr.fileno()`` while it compiles its
    test program, and reports 'incompatible' when stderr has no descriptor (notebooks, pytest's
    capture). Lend it the process's real stderr for the duration."""
    try:
        sys.stderr.fileno()
        yield
        return
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        pass
    saved = sys.stderr
    sys.stderr = sys.__stderr__ if sys.__stderr__ is not None else saved
    try:
        yield
    finally:
        sys.stderr = saved


# -- resource checks, done before DeepNVMe would abort on them --------------------------------


def can_lock(nbytes: int) -> Tuple[bool, str]:
    """Whether ``nbytes`` more can be page-locked (DeepNVMe asserts when mlock fails)."""
    try:
        with open("/proc/self/status") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
        if int(status["CapEff"].strip(), 16) >> CAP_IPC_LOCK & 1:
            return True, ""
        locked = int(status.get("VmLck", "0 kB").split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        locked = 0
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or locked + nbytes <= soft:
        return True, ""
    return False, (f"the aio engine needs {nbytes} bytes of page-locked staging buffers, but "
                   f"RLIMIT_MEMLOCK allows {soft} ({locked} already locked); raise it (`ulimit -l "
                   f"unlimited`, or memlock in /etc/security/limits.conf / docker --ulimit "
                   f"memlock=-1), or lower io_threads or chunk_bytes")


def check_aio_events(contexts: int, queue_depth: int) -> None:
    """Each handle thread calls io_setup(queue_depth); DeepNVMe ignores its failure and later
    asserts in io_submit, so check the system-wide budget first."""
    try:
        with open("/proc/sys/fs/aio-max-nr") as fh:
            limit = int(fh.read())
        with open("/proc/sys/fs/aio-nr") as fh:
            used = int(fh.read())
    except (OSError, ValueError):
        return
    # The kernel reserves max(depth, 4 * cpus) * 2 events per context.
    need = contexts * max(queue_depth, 4 * (os.cpu_count() or 1)) * 2
    if used + need > limit:
        raise EngineError(f"the aio engine needs about {need} libaio events but fs.aio-max-nr={limit} "
                          f"and {used} are in use; raise it (sysctl -w fs.aio-max-nr={used + need * 2}) "
                          f"or lower io_threads / aio_queue_depth / aio_intra_op_parallelism")
