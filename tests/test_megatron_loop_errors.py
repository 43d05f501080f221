"""An error of ours inside Megatron-LM's running training loop is one ERROR line per rank,
before the traceback, so that ``grep`` finds it in a thousand-rank log (megatron/errors.py).

Megatron-LM's own loop (``megatron.training.pretrain`` of the megatron-core 0.17+ wheels, on
CPU over gloo, as tests/test_megatron_training_loop.py runs it) trains through the launcher on
2 processes (data parallel 2); from iteration 2 on every read the offloader's posix engine
makes fails with EIO (tests/megatron_lm_wheel_pretrain.py ``SSDTRAIN_TEST_READ_EIO_AT``: the
FaultyEngine of tools/faults.py, the engine's real error path). The read is retried, then the
backward stops with our error. Each rank must log it exactly once, at ERROR level, naming the
rank and the node, before any traceback; the traceback stays.

Skipped on megatron-core 0.16 (no ``megatron.training``): run with ``make test-mcore-0.17``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("megatron.core")

from tests.tiny_gpt_flags import MEGATRON_LM_CPU, needs_megatron_training, tiny_gpt  # noqa: E402

pytestmark = needs_megatron_training()

SCRIPT = os.path.join(HERE, "megatron_lm_wheel_pretrain.py")


def test_an_io_error_inside_megatrons_loop_is_one_error_line_per_rank_before_the_traceback(tmp_path):
    """Broken variant (run_script's ``report_error(exc)`` removed, launch.py): no line:
    "assert [] == ['0', '1']"."""
    import megatron_lm_cpu_compat

    site = str(tmp_path / "site")
    megatron_lm_cpu_compat.write_sitecustomize(site, None)
    root = tmp_path / "ssd"
    root.mkdir()
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1",
               SSDTRAIN_TEST_READ_EIO_AT="2")
    env["PYTHONPATH"] = os.pathsep.join([site, os.path.dirname(HERE)]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    # --monitor-interval 5: torchrun stops the other worker once one has failed; both fail in
    # the same backward, and each must get to say so.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "5", "-m", "ssdtrain_megatron.launch", SCRIPT,
           "--tensor-model-parallel-size", "1", *tiny_gpt(3), *MEGATRON_LM_CPU,
           "--ssd-offload", "--ssd-offload-dir", str(root), "--ssd-offload-allow-system-disk",
           "--ssd-offload-min-tensor-bytes", "0", "--ssd-offload-keep-last-layers", "0",
           "--ssd-offload-engine", "posix"]  # the drive's reads fail: named, not the node's choice
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=480)
    lines = proc.stdout.splitlines()
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert re.search(r"iteration\s+1/\s*3 \|.*lm loss:", proc.stdout), proc.stdout[-4000:]  # it ran
    ours = re.compile(rf"^ERROR:ssdtrain_megatron\.megatron\.errors:ssdtrain: rank (\d) on node "
                      rf"{re.escape(socket.gethostname())} stopped: (\w+): (.*) \(traceback below\)$")
    found = [(i, ours.match(line)) for i, line in enumerate(lines) if ours.match(line)]
    assert sorted(m.group(1) for _, m in found) == ["0", "1"], proc.stdout[-6000:]
    for _, m in found:  # the read that failed past its retries, with the drive's error
        assert "Input/output error" in m.group(3) and str(root) in m.group(3), m.group(0)
    # Before the traceback, which stays (torch prefixes a worker's with "[rank<R>]: ").
    for i, m in found:
        own = [j for j, line in enumerate(lines) if "Traceback (most recent call last)" in line
               and line.startswith((f"[rank{m.group(1)}]: ", "Traceback"))]
        assert own and i < min(own), proc.stdout[-6000:]
    assert os.listdir(root) == [], "offload files were left behind"
