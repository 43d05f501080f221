"""io/owner.py and io/clean.py: liveness by lock, not by guess; owner records as untrusted input.

A job holds an flock on its owner.json for its life. A sweep removes a directory only when it
can take that lock and every holder would share this kernel's locks (same boot id, any pid
namespace), or the directory was last changed before this node booted on a local filesystem.
Another machine with the same hostname (another boot id) on a shared filesystem is "cannot
tell", whatever its pid says; ``--older-than`` is the way out for those. A record another user
planted (60,000 '[', a pid of 2**40) is "unknown", never a crash of a job's start or of
``ssdtrain clean``.

Real processes, real pid namespaces (``unshare --pid --fork``, root; skipped otherwise), real
locks on a real filesystem. The one stand-in: the type of a shared filesystem (NFS, Lustre)
cannot be mounted here, so one test makes ``owner.filesystem_type`` say "nfs4".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.io import Identity, make_engine, owner
from ssdtrain_megatron.io.clean import LIVE, STALE, UNKNOWN, clean_root, scan_root, sweep_before_start
from ssdtrain_megatron.io.layout import rank_dir_name
from ssdtrain_megatron.tools.clean import add_clean_parser
from tests.throwaway_users import throwaway_user

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = Identity.detect("x").hostname


def _clean_cli(argv):
    parser = argparse.ArgumentParser(prog="ssdtrain")
    add_clean_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["clean", *argv])
    return args.func(args)


def _record_dir(root, pid=4242, host=HOST, job="old", boot="another machine's boot id", lock="flock",
                raw=None):
    """A rank directory with an owner.json (``raw`` bytes as is, else a record) and a slab."""
    d = os.path.join(root, rank_dir_name(job, host, 0, pid))
    os.makedirs(d, mode=0o700)
    data = raw if raw is not None else json.dumps(
        {"pid": pid, "hostname": host, "job": job, "rank": 0, "boot_id": boot, "lock": lock}).encode()
    with open(os.path.join(d, "owner.json"), "wb") as fh:
        fh.write(data)
    with open(os.path.join(d, "slab.bin"), "wb") as fh:
        fh.write(b"x" * 8192)
    return d


def _age(directory, seconds: float) -> None:
    """Make nothing in ``directory`` changed for ``seconds`` (modification times moved back)."""
    t = time.time() - seconds
    for name in os.listdir(directory):
        os.utime(os.path.join(directory, name), (t, t))
    os.utime(directory, (t, t))


# -- another machine with the same hostname on a shared filesystem ---------------------------


def test_a_running_job_of_another_machine_with_our_hostname_is_never_removed(tmp_path, capsys):
    """Pods with a fixed hostname on a shared filesystem: the record names our hostname, another
    boot id, a lock we cannot see (it is on the other machine), and its slab was written just
    now. Broken by main's rule ("another boot id: the node rebooted, so the job is gone") or by
    trusting a free lock on another kernel: the sweep, a job's start and `ssdtrain clean` remove it."""
    root = tmp_path / "shared"
    d = _record_dir(root)
    (item,) = scan_root(str(root))
    assert item.verdict == UNKNOWN and item.undecided, item
    assert "another machine or an earlier boot" in item.reason
    # A job's start-up sweep on the same root, and `ssdtrain clean`, leave it.
    sweep_before_start([str(root)])
    assert _clean_cli([str(root)]) == 0
    assert "skipped" in capsys.readouterr().out
    engine = make_engine(OffloadConfig(dirs=[str(root)], job="mine", engine="posix"))
    try:
        assert os.path.isdir(d) and sorted(os.listdir(d)) == ["owner.json", "slab.bin"]
    finally:
        engine.close()
    # --older-than removes it only when nothing in it changed for that long.
    assert _clean_cli(["--older-than", "1h", str(root)]) == 0
    assert os.path.isdir(d)
    _age(d, 100)
    assert _clean_cli(["--dry-run", "--older-than", "2m", str(root)]) == 0
    assert os.path.isdir(d)
    assert _clean_cli(["--older-than", "60s", str(root)]) == 0
    out = capsys.readouterr().out
    assert "removed" in out and "(--older-than)" in out and not os.path.exists(d)


def test_a_node_that_rebooted_finds_its_leftovers_dead_on_a_local_filesystem_only(tmp_path, monkeypatch):
    """Another boot id and nothing changed since before this boot: on a local filesystem (only
    this node writes there) the owner is gone; on a shared one (stand-in: the type says nfs4)
    it may be another machine's idle job. Broken by dropping the filesystem test: the nfs4
    directory is removed."""
    booted = owner.boot_time()
    assert booted is not None
    root = tmp_path / "nvme0"
    d = _record_dir(root)
    _age(d, time.time() - booted + 60)  # last changed a minute before this boot
    (item,) = scan_root(str(root))
    assert item.verdict == STALE and "before this node last booted" in item.reason, item
    monkeypatch.setattr(owner, "filesystem_type", lambda fd: "nfs4")
    (item,) = clean_root(str(root))
    assert item.verdict == UNKNOWN and not item.removed and "nfs4" in item.reason, item
    monkeypatch.undo()
    (item,) = clean_root(str(root))
    assert item.removed and not os.path.exists(d)


def test_the_filesystem_type_is_read_from_the_open_file():
    with open(__file__, "rb") as fh:
        fstype = owner.filesystem_type(fh.fileno())
    mounts = {line.split(" - ")[1].split()[0] for line in open("/proc/self/mountinfo")}
    assert fstype in mounts


# -- the lock ---------------------------------------------------------------------------------


def test_a_live_job_holds_its_lock_and_a_free_lock_on_this_kernel_means_dead(tmp_path):
    """Broken by not taking the lock (hold_owner_lock a no-op): the record says "flock" but no
    one holds it, and the sweep calls the running engine's directory stale."""
    root = tmp_path / "nvme0"
    root.mkdir()
    engine = make_engine(OffloadConfig(dirs=[str(root)], job="live", engine="posix"))
    try:
        engine.write(0, torch.ones(4096, dtype=torch.uint8)).result(30)
        (item,) = clean_root(str(root))
        assert item.verdict == LIVE and "locked" in item.reason and os.path.isdir(engine.rank_dirs[0])
        rec = json.load(open(os.path.join(engine.rank_dirs[0], "owner.json")))
        assert rec["lock"] == "flock" and rec["boot_id"] == owner.boot_id()
    finally:
        engine.close()
    # The same record, lock free (its writer gone), this boot: dead, whatever its pid says.
    d = _record_dir(root, pid=os.getpid(), boot=owner.boot_id())
    (item,) = clean_root(str(root))
    assert item.verdict == STALE and item.removed and not os.path.exists(d), item


def test_a_closed_engine_lets_its_lock_go(tmp_path):
    """Each engine holds one descriptor for its lock while open; closed, it is let go at the
    next start at the latest (broken by never closing it: the count grows by one per engine)."""
    root = tmp_path / "nvme0"
    root.mkdir()
    # Lets go of what earlier tests' closed engines held; a record left on a filesystem that
    # turned read-only keeps its lock for this process's life, as a job's would.
    base = owner.held_locks()
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        engine = make_engine(OffloadConfig(dirs=[str(root)], job=f"j{i}", engine="posix"))
        assert owner.held_locks() == base + 1
        engine.close()
    assert owner.held_locks() == base
    assert len(os.listdir("/proc/self/fd")) == fds


# -- records as untrusted input ---------------------------------------------------------------


BAD_RECORDS = {
    "60,000 '['": (b"[" * 60000, "larger than"),
    "deep but small": (b"[" * 3000, "nests deeper"),
    "pid 2**40": (None, "pid 1099511627776"),
    "pid 0": (None, "pid 0"),
    "pid true": (None, "pid True"),
    "rank -1": (None, "rank -1"),
    "not an object": (b"[1, 2]", "not a JSON object"),
    "not utf-8": (b'{"pid": "\xff"}', "utf-8"),
    "lock maybe": (None, "lock 'maybe'"),
}


def _bad(name: str) -> bytes:
    raw, _ = BAD_RECORDS[name]
    if raw is not None:
        return raw
    rec = {"pid": 4242, "hostname": HOST, "job": "old", "rank": 0, "boot_id": owner.boot_id(), "lock": "flock"}
    key, value = {"pid 2**40": ("pid", 2 ** 40), "pid 0": ("pid", 0), "pid true": ("pid", True),
                  "rank -1": ("rank", -1), "lock maybe": ("lock", "maybe")}[name]
    rec[key] = value
    return json.dumps(rec).encode()


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_a_bad_owner_record_is_unknown_never_a_crash(tmp_path, name, other_user, capsys):
    """Planted by another user (where we are root: a throwaway user owns the directory) under a
    root a root-run job sweeps. Broken on main by 60,000 '[' (RecursionError) and a pid of 2**40
    (OverflowError in os.kill): every root-run job's start and `ssdtrain clean` failed."""
    root = tmp_path / "raid"
    d = _record_dir(root, raw=_bad(name))
    if other_user is not None:
        for p in (d, os.path.join(d, "owner.json"), os.path.join(d, "slab.bin")):
            os.chown(p, other_user, other_user)
    (item,) = scan_root(str(root))
    assert item.verdict == UNKNOWN and not item.undecided, item
    assert BAD_RECORDS[name][1] in item.reason, item.reason
    assert _clean_cli([str(root)]) == 0
    assert "skipped" in capsys.readouterr().out
    engine = make_engine(OffloadConfig(dirs=[str(root)], job="mine", engine="posix"))  # its sweep
    engine.close()
    assert os.path.isdir(d)


@pytest.fixture
def other_user():
    """A throwaway user's uid where we are root (removed afterwards); None otherwise."""
    with throwaway_user("ssdt") as uid:
        yield uid


# -- another pid namespace (a container) ------------------------------------------------------


POD = """
import json, os, sys
import torch
from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.io import make_engine
engine = make_engine(OffloadConfig(dirs=[sys.argv[1]], job="pod", engine="posix"))
engine.write(0, torch.ones(8192, dtype=torch.uint8)).result(30)
# /proc is the parent namespace's here (no --mount-proc): /proc/self names our pid there.
print(json.dumps({"dirs": engine.rank_dirs, "pid": os.getpid(), "host_pid": int(os.readlink("/proc/self"))}),
      flush=True)
sys.stdin.readline()
"""


def _unshare_refused():
    if os.geteuid() != 0:
        return "a new pid namespace needs root"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    r = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare --pid refused: {r.stderr.strip()}"


class Pod:
    """A process in a pid namespace of its own (pid 1 there, as in a container)."""

    def __init__(self, root, code: str = POD, args=()) -> None:
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code,
                                      str(root), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        out = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        if not out or not out[0]:
            self.proc.kill()
            raise AssertionError(f"pod failed to start: {self.proc.stderr.read()}")
        self.ready = json.loads(out[0])

    def kill(self) -> None:
        """SIGKILL, as an out-of-memory kill or a node agent would: nothing of ours runs."""
        os.kill(self.ready["host_pid"], signal.SIGKILL)
        self.proc.wait(60)  # unshare exits once its child is gone: the lock went with it
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(60)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


@pytest.mark.skipif(_unshare_refused() is not None, reason=str(_unshare_refused()))
def test_a_job_in_another_pid_namespace_is_live_while_it_runs_and_cleared_once_killed(tmp_path, capsys):
    """Broken on main: another pid namespace was "cannot tell" forever; the killed pod's
    directory stayed and the restarted pod (pid 1 again: the same directory name) was refused
    "already exists (in use)". Broken here by judging by pid again: the live pod's pid 1 is
    not its pid in our namespace."""
    root = tmp_path / "nvme0"
    root.mkdir()
    first = Pod(root)
    try:
        assert first.ready["pid"] == 1
        (d,) = first.ready["dirs"]
        (item,) = clean_root(str(root))
        assert item.verdict == LIVE and os.path.isdir(d), item
        first.kill()
        # The restarted pod: same job, same host, pid 1 again. Its start-up sweep clears the
        # dead one's directory, which has its own directory's name.
        second = Pod(root)
        try:
            assert second.ready["dirs"] == [d]
            (item,) = scan_root(str(root))
            assert item.verdict == LIVE
            second.kill()
            assert _clean_cli([str(root)]) == 0
            assert "removed" in capsys.readouterr().out and os.listdir(root) == []
        finally:
            second.close()
    finally:
        first.close()


CLEAN_IN_POD = """
import sys
from ssdtrain_megatron.tools.cli import main
print('{"ready": true}', flush=True)
sys.exit(main(["clean", sys.argv[1]]))
"""


@pytest.mark.skipif(_unshare_refused() is not None, reason=str(_unshare_refused()))
def test_clean_in_another_pid_namespace_leaves_our_live_job_and_removes_our_dead_one(tmp_path):
    """The other way round: `ssdtrain clean` run in a container sees our running engine (its
    pid means nothing there) as live, and a job of ours that was SIGKILLed as dead."""
    root = tmp_path / "nvme0"
    root.mkdir()
    engine = make_engine(OffloadConfig(dirs=[str(root)], job="host", engine="posix"))
    try:
        dead = subprocess.Popen([sys.executable, "-c", POD, str(root)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
        (dead_dir,) = json.loads(dead.stdout.readline())["dirs"]
        dead.kill()
        dead.wait(60)
        dead.stdin.close()
        dead.stdout.close()
        pod = Pod(root, CLEAN_IN_POD)
        out, err = pod.proc.communicate(timeout=120)
        pod.close()
        assert pod.proc.returncode == 0, err
        assert "live" in out and engine.rank_dirs[0] in out
        assert not os.path.exists(dead_dir) and os.path.isdir(engine.rank_dirs[0])
        engine.write(1, torch.ones(4096, dtype=torch.uint8)).result(30)
    finally:
        engine.close()


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("30m", 1800), ("1.5h", 5400), ("7d", 604800)])
def test_older_than_takes_a_duration_with_its_unit(text, seconds):
    parser = argparse.ArgumentParser(prog="ssdtrain")
    add_clean_parser(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["clean", "--older-than", text, "/x"]).older_than == seconds


@pytest.mark.parametrize("text", ["5", "5x", "1 week", "h"])
def test_older_than_without_a_unit_is_one_line_naming_the_flag(text, capsys):
    parser = argparse.ArgumentParser(prog="ssdtrain")
    add_clean_parser(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["clean", "--older-than", text, "/x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--older-than" in err and "expected a duration such as 90s, 30m, 12h or 7d" in err
