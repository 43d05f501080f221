"""io/cleanup.py: the exit/signal cleaners put the previous SIGINT/SIGTERM handlers back when
the last offloader closes, and never keep an offloader alive; an engine's own cleaner still
removes its files at exit or on a signal. Real signals, in a child process each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import gc, os, signal, sys, time, weakref
import torch
from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io import cleanup
ROOT = sys.argv[1]

def offloader(name, **kw):
    os.makedirs(os.path.join(ROOT, name), exist_ok=True)  # the drive, mounted
    return ActivationOffloader(OffloadConfig(dirs=[os.path.join(ROOT, name)], job="t", **kw),
                               device=torch.device("cpu"))

def wait_for(cond):  # a signal raised here is handled at the next bytecode; poll, no fixed sleep
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.001)
"""


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)


def _entries(root) -> list:
    """Everything under ``root`` (files and directories), relative to it."""
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def test_the_previous_handlers_are_back_when_the_last_offloader_closes(tmp_path):
    r = _run(tmp_path, """
        got = []
        def mine(signum, frame):
            got.append(signum)
        signal.signal(signal.SIGTERM, mine)
        int_before = signal.getsignal(signal.SIGINT)
        a, b = offloader("a"), offloader("b")
        assert signal.getsignal(signal.SIGTERM) is cleanup._on_signal
        a.close()
        assert signal.getsignal(signal.SIGTERM) is cleanup._on_signal  # b is still open
        b.close()
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is int_before
        assert cleanup.registered() == 0
        signal.raise_signal(signal.SIGTERM)  # the program's own handler, not ssdtrain's
        wait_for(lambda: got == [signal.SIGTERM])
        c = offloader("c")  # the next offloader installs them again
        assert signal.getsignal(signal.SIGTERM) is cleanup._on_signal
        c.close()
        try:
            signal.raise_signal(signal.SIGINT)  # Python's own: KeyboardInterrupt
            wait_for(lambda: False)
        except KeyboardInterrupt:
            print("interrupted")
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["interrupted", "ok"]
    assert [_entries(tmp_path / n) for n in "abc"] == [[], [], []]


def test_a_dropped_offloader_is_collected_and_a_signal_still_removes_its_files(tmp_path):
    r = _run(tmp_path, """
        off = offloader("a")
        dirs = off.rank_dirs
        ref = weakref.ref(off)
        del off
        gc.collect()
        assert ref() is None, gc.get_referrers(ref())  # the registry did not keep it alive
        assert all(os.path.isdir(d) for d in dirs)      # nobody closed it: its files are there
        print("ready", flush=True)
        signal.raise_signal(signal.SIGTERM)
        wait_for(lambda: False)
    """)
    assert r.returncode == -signal.SIGTERM, r.stderr  # it died of the signal, as it should
    assert r.stdout.split() == ["ready"]
    assert _entries(tmp_path / "a") == []  # the engine's own cleaner removed the rank directory


def test_a_dropped_offloader_leaves_nothing_at_normal_exit(tmp_path):
    r = _run(tmp_path, """
        off = offloader("a")
        ref = weakref.ref(off)
        del off
        gc.collect()
        assert ref() is None
        assert cleanup.registered() == 1  # the engine's cleaner only
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert _entries(tmp_path / "a") == []


def test_bound_methods_are_held_weakly_unless_kept_alive(tmp_path):
    r = _run(tmp_path, """
        ran = []
        class Owner:
            def clean(self):
                ran.append("weak")
        class Kept:
            def clean(self):
                ran.append("kept")
        weak, kept = Owner(), Kept()
        cleanup.register("weak", weak.clean)
        cleanup.register("kept", kept.clean, keep_alive=True)
        cleanup.register("plain", lambda: ran.append("plain"))
        refs = weakref.ref(weak), weakref.ref(kept)
        del weak, kept
        gc.collect()
        assert refs[0]() is None and refs[1]() is not None
        assert cleanup.registered() == 2
        cleanup._run_all()
        assert sorted(ran) == ["kept", "plain"], ran
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok"]


def test_a_ctrl_c_landing_inside_a_del_still_ends_the_job_as_interrupted(tmp_path):
    """SIGINT runs the cleaners, then the previous handler raises KeyboardInterrupt. Raised
    while Python runs a ``__del__`` (a dropped handle), it cannot leave it: Python printed it
    as "Exception ignored" and ran on (seen in CI: `ssdtrain demo` exited 1 with
    "ActivationOffloader is closed"; after a first fix, 130 but with that traceback). The
    signal is delivered again once the ``__del__`` is over, and nothing is printed. An
    offloader or engine closed by those cleaners, used again, raises KeyboardInterrupt, never
    "closed"; one closed by nobody still says "closed"."""
    r = _run(tmp_path, """
        class Drop:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)  # the handler runs here, inside __del__
                time.sleep(0.01)

        off = offloader("a")
        engine = off.engine
        d = Drop()
        try:
            del d
            wait_for(lambda: False)  # only the interrupt, delivered again, ends this
        except KeyboardInterrupt:
            print("interrupted after the __del__", flush=True)
        for what, call in (("engine", lambda: engine.write(0, torch.zeros(8))),
                           ("offloader", lambda: off.microbatch(0).__enter__())):
            try:
                call()
            except KeyboardInterrupt:
                print(what, "interrupted", flush=True)
        other = offloader("b")  # closed by nobody: "closed" stays what it was
        other.close()
        try:
            other.microbatch(0).__enter__()
        except RuntimeError as exc:
            print("other:", exc, flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:4] == ["interrupted after the __del__", "engine interrupted",
                                        "offloader interrupted",
                                        "other: ActivationOffloader is closed"], (r.stdout, r.stderr)
    assert "KeyboardInterrupt" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert _entries(tmp_path / "a") == []


def test_a_ctrl_c_from_outside_stops_a_loop_that_spends_its_time_in_del(tmp_path):
    """The signal from another process, while the main thread runs ``__del__`` methods most of
    the time (a loop dropping objects with a busy ``__del__``): the loop still ends with a
    KeyboardInterrupt, and nothing is printed as ignored. Before the deferral, the interrupt
    often landed in a ``__del__``: Python printed "Exception ignored" and the loop ran on."""
    code = PRELUDE + textwrap.dedent("""
        off = offloader("a")
        class Busy:
            def __del__(self):
                x = 0
                for i in range(500):
                    x += i
        print("ready", flush=True)
        try:
            while True:
                b = Busy()
                del b
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)  # SIGINT: see conftest.py
        try:
            assert proc.stdout.readline() == "ready\n"
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0 and out == "interrupted\n", (out, err)
        assert "Exception ignored" not in err, err
        assert _entries(tmp_path / "a") == []


def test_a_handler_that_lets_the_job_go_on_gets_the_signal_and_offload_goes_on(tmp_path):
    """A Python handler installed before ours that only notes the signal (as Megatron's
    ``--exit-signal-handler`` does: finish the iteration, save, exit) gets SIGTERM, SIGUSR1 and
    SIGUSR2; the offloader keeps writing and reading, and its files go when it closes. Fails if
    the cleaners run before the handler ("engine is closed", issue 29)."""
    r = _run(tmp_path, """
        import logging
        logging.basicConfig(level=logging.INFO)
        got = []
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda signum, frame: got.append(signum))
        off = offloader("a", min_tensor_bytes=0, keep_last_layers=0)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            assert signal.getsignal(sig) is cleanup._on_signal
            signal.raise_signal(sig)
        wait_for(lambda: len(got) == 3)
        # A step after the signals: its activations go to the drive and come back, exactly.
        leaf = torch.randn(8, 512, requires_grad=True)
        with off.microbatch(0):
            out = (leaf * 2.0).relu() * 3.0
        off.wait_writes()
        out.sum().backward()
        st = off.end_step()
        assert st.bytes_offloaded > 0 and st.bytes_read > 0, st
        assert torch.equal(leaf.grad.view(torch.int32), torch.where(leaf > 0, 6.0, 0.0).view(torch.int32))
        assert all(os.path.isdir(d) for d in off.rank_dirs)  # still there while the job runs
        off.close()
        print(sorted(got) == sorted([signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2]), flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"], (r.stdout, r.stderr)
    assert "passed on to" in r.stderr and "closed" not in r.stderr, r.stderr
    assert _entries(tmp_path / "a") == []


def test_a_handler_that_lets_the_job_go_on_still_leaves_nothing_at_exit(tmp_path):
    """The job noted the signal and ends on its own (Megatron: ``sys.exit`` after saving),
    without closing the offloader: the atexit cleaners remove the files."""
    r = _run(tmp_path, """
        got = []
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
        off = offloader("a")
        signal.raise_signal(signal.SIGTERM)
        wait_for(lambda: got)
        assert all(os.path.isdir(d) for d in off.rank_dirs)
        sys.exit(0)
    """)
    assert r.returncode == 0, r.stderr
    assert _entries(tmp_path / "a") == []


def test_a_handler_that_ends_the_job_finds_the_files_already_removed(tmp_path):
    """A handler that raises (SystemExit here, as Megatron's ``--exit-signal-handler-for-
    training`` does): the files are gone before the exception unwinds the job."""
    r = _run(tmp_path, """
        def ends_the_job(signum, frame):
            print("handler sees", [os.path.exists(d) for d in dirs], flush=True)
            raise SystemExit(7)
        signal.signal(signal.SIGTERM, ends_the_job)
        off = offloader("a")
        dirs = off.rank_dirs
        try:
            signal.raise_signal(signal.SIGTERM)
            wait_for(lambda: False)
        except SystemExit as exc:
            print(exc.code, [os.path.exists(d) for d in dirs], flush=True)
    """)
    assert r.returncode == 0, r.stderr
    # The handler runs first (the files are still there), the cleaners before the job unwinds.
    assert r.stdout.split("\n")[:2] == ["handler sees [True]", "7 [False]"], (r.stdout, r.stderr)


def test_an_ignored_signal_stays_ignored_and_offload_goes_on(tmp_path):
    """SIGTERM ignored before the offloader started (nohup-like set-ups): the job goes on, so
    must the offloader (it used to be closed under the running job)."""
    r = _run(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        off = offloader("a")
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.05)
        f = off.engine.write(1, torch.ones(1024))
        if f is not None:
            f.result()
        off.close()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        print("ok", flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok"]
    assert _entries(tmp_path / "a") == []


def test_sigusr1_with_no_handler_removes_the_files_and_the_job_dies_of_it(tmp_path):
    """Slurm's ``--signal=USR1@...`` sent to a job that does not handle it: the default action
    ends it, as before; now its offload files go first."""
    r = _run(tmp_path, """
        off = offloader("a")
        print("ready", flush=True)
        signal.raise_signal(signal.SIGUSR1)
        wait_for(lambda: False)
    """)
    assert r.returncode == -signal.SIGUSR1, r.stderr
    assert _entries(tmp_path / "a") == []
