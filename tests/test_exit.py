"""A job that installs the offloader exits with its own status, whether or not it calls
uninstall(), several runs in a row (real processes, PP=2 over gloo, megatron-core GPT)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Tuple

import pytest

from ranks import HERE, REPO, free_port

pytest.importorskip("megatron.core")

RUNS = 3


def _launch(mode: str, workdir: str, timeout_s: float = 240.0) -> List[Tuple[int, str]]:
    """Start the two ranks of exit_harness in ``mode``; (exit status, log) per rank."""
    os.makedirs(workdir, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env["PYTHONPATH"] = os.pathsep.join([REPO, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "import exit_harness as h; h._worker_main()", mode, workdir],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, text=True))
    out = []
    try:
        for p in procs:
            log, _ = p.communicate(timeout=timeout_s)
            out.append((p.returncode, log))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _offload_files(workdir: str) -> List[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(os.path.join(workdir, "offload")) for f in files]


@pytest.mark.parametrize("mode,status", [("forget_uninstall", 0), ("raise", 1)])
def test_a_job_that_never_uninstalls_exits_with_its_own_status(tmp_path, mode, status):
    """Before the fix, 2 of 3 runs of "forget_uninstall" died with SIGABRT ("terminate called
    without an active exception") at interpreter shutdown."""
    for run in range(RUNS):
        workdir = str(tmp_path / f"{mode}{run}")
        results = _launch(mode, workdir)
        for rank, (rc, log) in enumerate(results):
            assert rc == status, f"run {run}, rank {rank} exited {rc}, expected {status}:\n{log[-3000:]}"
            assert "terminate called" not in log, log[-3000:]
            assert f"rank {rank}: trained 3 iterations" in log, log[-3000:]
            if mode == "raise":
                assert "deliberate failure at the end of training" in log
        # The exit path also removes what the job wrote.
        assert _offload_files(workdir) == []
