"""io/cleanup.py after fork: a forked child never removes its parent's running job's files.

A DataLoader worker or any ``multiprocessing`` fork-context process inherits the cleaner
registry, the atexit hook and the signal handlers. Stopped with ``terminate()`` (SIGTERM, what
PyTorch's DataLoader does to a worker that does not exit in time), or a bare ``os.fork()`` child
that exits normally: the parent's rank directory and its next write must survive. Real
processes and real signals; each case runs in a fresh interpreter (a fork from inside pytest,
which has threads, would fork pytest too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import json, multiprocessing, os, signal, sys
import torch
from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.io import make_engine
ROOT = sys.argv[1]
engine = make_engine(OffloadConfig(dirs=[ROOT], job="fork", engine="posix"))
engine.write(0, torch.arange(4096, dtype=torch.uint8)).result(30)

def after():  # in the parent, once the child is gone: the directory, and a write and a read
    present = [os.path.isdir(d) for d in engine.rank_dirs]
    data = torch.arange(8192, dtype=torch.int32)
    engine.write(1, data).result(30)
    out = torch.empty_like(data)
    engine.read(1, out).result(30)
    same = bool(torch.equal(out.view(torch.uint8), data.view(torch.uint8)))
    print(json.dumps({"present": present, "roundtrip": same, "files": sorted(os.listdir(engine.rank_dirs[0]))}))
    engine.close()
"""


def _run(tmp_path, body: str) -> dict:
    root = tmp_path / "nvme0"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(root)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert os.listdir(root) == [], "the parent's close left files"
    return result


def test_a_fork_context_child_stopped_with_terminate_leaves_the_parents_files(tmp_path):
    """Broken by running every registered cleaner in the child (no pid check, registry kept):
    the child's SIGTERM handler removes the parent's directory; 'present' is False."""
    result = _run(tmp_path, """
        def worker(started):
            started.set()
            signal.pause()  # a worker busy or stuck: terminate() has to stop it

        ctx = multiprocessing.get_context("fork")
        started = ctx.Event()
        child = ctx.Process(target=worker, args=(started,))
        child.start()
        assert started.wait(60)
        child.terminate()
        child.join(60)
        assert child.exitcode == -signal.SIGTERM, child.exitcode  # it died of the signal, as before
        after()
    """)
    assert result == {"present": [True], "roundtrip": True, "files": ["owner.json", "slab.bin"]}


def test_a_bare_fork_child_that_exits_leaves_the_parents_files(tmp_path):
    """Broken the same way: the child's atexit hook runs the parent's cleaners."""
    result = _run(tmp_path, """
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: the interpreter runs its atexit hooks
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        after()
    """)
    assert result == {"present": [True], "roundtrip": True, "files": ["owner.json", "slab.bin"]}


def test_a_child_still_runs_its_own_cleaners(tmp_path):
    """The registry is emptied in the child, not disabled: an engine the child opens itself is
    still removed when the child exits (broken by ignoring every registration in a child)."""
    result = _run(tmp_path, """
        os.mkdir(os.path.join(ROOT, "child"))  # its drive
        pid = os.fork()
        if pid == 0:
            own = make_engine(OffloadConfig(dirs=[os.path.join(ROOT, "child")], job="child", engine="posix"))
            own.write(0, torch.ones(4096, dtype=torch.uint8)).result(30)
            sys.exit(0)  # never closed: its cleaner removes its directory at exit
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        left = os.listdir(os.path.join(ROOT, "child"))
        os.rmdir(os.path.join(ROOT, "child"))
        after()
        print(json.dumps({"child_left": left}))
    """)
    assert result == {"child_left": []}


ORPHAN = """
import json, os, signal, sys
import torch
from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.io import make_engine
engine = make_engine(OffloadConfig(dirs=[sys.argv[1]], job="orphan", engine="posix"))
engine.write(0, torch.arange(4096, dtype=torch.uint8)).result(30)
child = os.fork()
if child == 0:
    signal.pause()  # a worker that outlives its parent
    os._exit(0)
print(json.dumps({"dirs": engine.rank_dirs, "child": child}), flush=True)
sys.stdin.readline()
"""


def test_a_forked_child_does_not_keep_a_dead_parents_directory_alive(tmp_path):
    """The lock on owner.json is the parent's: a child's inherited copy is closed at the fork,
    so once the parent is SIGKILLed its directory is dead even while the child runs (broken by
    keeping the copies: the orphan holds the lock, and the directory looks live forever)."""
    from ssdtrain_megatron.io.clean import STALE, scan_root

    root = tmp_path / "nvme0"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN, str(root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    ready = json.loads(proc.stdout.readline())
    try:
        os.kill(proc.pid, 9)
        proc.wait(60)
        os.kill(ready["child"], 0)  # the orphan still runs
        (item,) = scan_root(str(root))
        assert item.verdict == STALE, item
    finally:
        try:
            os.kill(ready["child"], 9)
        except ProcessLookupError:
            pass
        proc.stdin.close()
        proc.stdout.close()
