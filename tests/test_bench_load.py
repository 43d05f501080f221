"""`ssdtrain bench --background-load N`: the busy processes run while the bench runs and none
survives it: not at a normal end, not after an error, not after Ctrl-C, not even after a
SIGKILL of the bench. Real processes; nothing here is faked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ssdtrain_megatron.tools.bench.background_load import BackgroundLoad
from ranks import REPO


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_the_processes_spin_inside_the_block_and_are_gone_after_it():
    """Broken by making stop() a no-op: 'left behind: [pid, pid]'."""
    with BackgroundLoad(2) as load:
        pids = load.pids
        assert len(pids) == 2 and all(alive(p) for p in pids)
        before = [cpu_ticks(p) for p in pids]
        time.sleep(1.0)
        assert all(cpu_ticks(p) > b for p, b in zip(pids, before))  # they compete for the CPU
    assert [p for p in pids if alive(p)] == [], f"left behind: {[p for p in pids if alive(p)]}"


def test_none_survives_an_error_inside_the_block():
    with pytest.raises(RuntimeError, match="boom"):
        with BackgroundLoad(2) as load:
            pids = load.pids
            raise RuntimeError("boom")
    assert [p for p in pids if alive(p)] == []
    with BackgroundLoad(0) as load:
        assert load.pids == []
    with pytest.raises(ValueError, match="processes=-1"):
        BackgroundLoad(-1)


_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from ssdtrain_megatron.tools.bench.background_load import BackgroundLoad
    with BackgroundLoad(2) as load:
        print(" ".join(map(str, load.pids)), flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_none_survives_ctrl_c_or_a_sigkill_of_the_bench(sig):
    """SIGINT: the with block's exit stops them. SIGKILL: nothing of the bench runs, each one
    sees its parent gone and exits. Broken by a spin loop that ignores its parent (while True):
    the SIGKILL case fails with 'left behind after SIGKILL'."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD.format(repo=str(REPO))], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.send_signal(sig)  # to the bench alone, not to its process group
        proc.wait(timeout=30)
        assert wait_gone(pids) == [], f"left behind after {sig.name}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids if "pids" in locals() else []:
            if alive(p):
                os.kill(p, signal.SIGKILL)
