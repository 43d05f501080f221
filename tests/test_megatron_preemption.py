"""Preemption as a cluster does it, in Megatron-LM's own training loop (``megatron.training``
from the megatron-core 0.17+ wheels) run through our launcher: SIGTERM with
``--exit-signal-handler`` lets Megatron finish the iteration, save its checkpoint and exit 0,
with ``--ssd-offload`` exactly as without it; the offload files are gone afterwards.

The tiny GPT of ``tests/megatron_lm_wheel_pretrain.py`` trains with PP=2 on 2 CPU processes
(gloo), 3 iterations; every rank sends itself SIGTERM at one named point of iteration 2
(``tests/preempt_points.py``: inside forward, backward, the loss, the optimizer step, an offload
write, a prefetch read, ...). Each run must save the checkpoint of iteration 2 (the iteration
Megatron chose: it checks the signal at the end of each), whose model and optimizer tensors are
bitwise equal (integer views) to those of the same run without offload; exit 0; no "closed"
error; bytes read back from the drive; nothing left under the offload root.

Before this worked, our SIGTERM handler removed the files and closed the engine, then called
Megatron's, which only notes the signal: the iteration in flight then failed with "engine is
closed" and no checkpoint was saved (issue 29). Break it by making ``cleanup._on_signal`` run
``_clean_for(signum)`` before ``prev(signum, frame)``: rank 0 fails with "EngineError: engine is
closed", rank 1 then waits in gloo and torchrun for both, the run is killed after
RUN_TIMEOUT_S with its workers, and ``assert run.returncode == 0`` fails (-9).

Time: a run takes about 20-30 s on 2 cores. The default suite runs the plain run, three points
(a forward, an offload write, a prefetch read) and the run without Megatron's handler; the
other seven points are marked slow (``pytest -m slow``). Skipped on megatron-core 0.16 (no
``megatron.training`` in its wheel): ``make test-mcore-0.17`` (or 0.18, 0.19) runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Dict, List

import pytest

if TYPE_CHECKING:
    import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("megatron.core")

from tests.bitwise import bitwise_equal, tensor_leaves  # noqa: E402
from tests.preempt_points import POINTS  # noqa: E402
from tests.tiny_gpt_flags import MEGATRON_LM_CPU, needs_megatron_training, tiny_gpt  # noqa: E402
from tests.two_nodes import kill_tree  # noqa: E402

pytestmark = needs_megatron_training()

SCRIPT = os.path.join(HERE, "megatron_lm_wheel_pretrain.py")
NPROC = 2  # PP=2: the 1F1B schedule, a forward and a backward of each stage per micro-batch
PREEMPTED_AT = 2  # of 3 iterations
RUN_TIMEOUT_S = 300  # a run takes 20-30 s; one that hangs (a rank failed) is killed
DEFAULT_POINTS = ("forward", "write", "read")

TINY_GPT = (["--pipeline-model-parallel-size", str(NPROC), "--position-embedding-type", "rope"]
            + tiny_gpt(3) + MEGATRON_LM_CPU)
# torch format: one file per rank, loadable here; save-interval: Megatron asserts one with --save.
CHECKPOINTING = ["--ckpt-format", "torch", "--save-interval", "1000"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    import megatron_lm_cpu_compat

    folder = str(tmp_path_factory.mktemp("site"))
    megatron_lm_cpu_compat.write_sitecustomize(folder, None)
    return folder


class Run:
    """One preempted training run: its exit status, output, checkpoint folder, offload root."""

    def __init__(self, folder, proc: subprocess.CompletedProcess) -> None:
        self.folder = folder
        self.returncode = proc.returncode
        self.output = proc.stdout
        self.save = folder / "ckpt"
        self.root = folder / "ssd"

    def checkpoint_iteration(self) -> str:
        path = self.save / "latest_checkpointed_iteration.txt"
        return path.read_text().strip() if path.exists() else "(none)"

    def tensors(self) -> Dict[str, "torch.Tensor"]:
        """Every model and optimizer tensor of every rank's checkpoint, by its path in it."""
        import torch

        out: Dict[str, "torch.Tensor"] = {}
        for rank_dir in sorted((self.save / f"iter_{PREEMPTED_AT:07d}").iterdir()):
            state = torch.load(rank_dir / "model_optim_rng.pt", map_location="cpu",
                               weights_only=False)
            assert state["iteration"] == PREEMPTED_AT
            for part in ("model", "optimizer"):
                tensor_leaves(f"{rank_dir.name}/{part}", state[part], out)
        return out


def _run(folder, site: str, point: str, offload: bool, handler: bool = True) -> Run:
    folder.mkdir()
    (folder / "ssd").mkdir()
    flags = [*TINY_GPT, *CHECKPOINTING, "--save", str(folder / "ckpt")]
    if handler:
        flags.append("--exit-signal-handler")
    program = [SCRIPT, *flags]
    if offload:
        # min-tensor-bytes 0: the tiny model's activations are all below the 256 KiB default;
        # the temporary folder may be on the system disk, which the pre-flight refuses unasked;
        # engine posix, named: the points preempt the drive's writes and reads, which the
        # node's choice (tiered, where host memory is to spare) would keep in host memory.
        program = ["-m", "ssdtrain_megatron.launch", *program, "--ssd-offload",
                   "--ssd-offload-dir", str(folder / "ssd"), "--ssd-offload-allow-system-disk",
                   "--ssd-offload-min-tensor-bytes", "0", "--ssd-offload-engine", "posix",
                   "--ssd-offload-stats-path", str(folder / "stats.jsonl")]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1",
               SSDTRAIN_TEST_PREEMPT=f"{point}@{PREEMPTED_AT}")
    env["PYTHONPATH"] = os.pathsep.join([site, os.path.dirname(HERE)]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(NPROC), *program]
    proc = subprocess.Popen(cmd, cwd=str(folder), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # A worker that failed can leave the others (and torchrun) waiting for ever; the
        # workers run in sessions of their own: kill every descendant, then report.
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        out += f"\n(test: killed after {RUN_TIMEOUT_S} s)"
    return Run(folder, subprocess.CompletedProcess(cmd, proc.returncode, out))


def _left_on_disk(root) -> List[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


@pytest.fixture(scope="module")
def plain(site, tmp_path_factory) -> Run:
    """The same run without offload: Megatron alone saves iteration 2's checkpoint."""
    run = _run(tmp_path_factory.mktemp("preempt") / "plain", site, "forward", offload=False)
    assert run.returncode == 0, run.output[-6000:]
    assert run.checkpoint_iteration() == str(PREEMPTED_AT), run.output[-6000:]
    return run


@pytest.mark.parametrize("point", [
    p if p in DEFAULT_POINTS else pytest.param(p, marks=pytest.mark.slow) for p in POINTS])
def test_sigterm_lets_megatron_save_the_same_checkpoint_with_offload(point, plain, site,
                                                                     tmp_path):
    run = _run(tmp_path / point, site, point, offload=True)
    tail = run.output[-6000:]
    assert run.returncode == 0, tail
    assert "closed" not in run.output, tail
    assert run.checkpoint_iteration() == str(PREEMPTED_AT), tail
    assert f"successfully saved checkpoint from iteration {PREEMPTED_AT:7d}" in run.output
    assert "SIGTERM passed on to DistributedSignalHandler" in run.output, tail
    expected, got = plain.tensors(), run.tensors()
    assert sorted(got) == sorted(expected) and len(expected) > 0
    assert [k for k in expected if not bitwise_equal(got[k], expected[k])] == []
    with open(run.folder / "stats.jsonl", encoding="utf-8") as fh:
        steps = [r for r in (json.loads(line) for line in fh if line.strip())
                 if "run" not in r]  # each run (and rank) starts with a header line
    # Both ranks offloaded and read back in every step, the preempted iteration 2 included.
    assert len(steps) == NPROC * PREEMPTED_AT, steps
    assert all(s["bytes_offloaded"] > 0 and s["bytes_read"] > 0 for s in steps), steps
    assert _left_on_disk(run.root) == [], "offload files were left behind"


def test_without_megatrons_handler_sigterm_still_removes_the_files_and_ends_the_job(site,
                                                                                   tmp_path):
    """No ``--exit-signal-handler``: nobody in Python handles SIGTERM, so the workers die of it
    (torchrun reports exit code -15 and fails), as without offload, and the offload files are
    removed first."""
    run = _run(tmp_path / "no-handler", site, "forward", offload=True, handler=False)
    assert run.returncode != 0
    assert "exitcode  : -15" in run.output, run.output[-6000:]
    assert run.checkpoint_iteration() == "(none)"
    assert _left_on_disk(run.root) == [], "offload files were left behind"


RESTARTS = """
import os, signal, sys, threading, time, typing
import torch
if not hasattr(typing, "override"):  # Python 3.12's; megatron.training 0.18+ imports it
    typing.override = lambda method: method  # (as tests/megatron_lm_cpu_compat.py does)
from megatron.training.dist_signal_handler import DistributedSignalHandler
from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.io import cleanup
from ssdtrain_megatron.megatron import install, installed, uninstall

root = sys.argv[1]
threads_before = set(threading.enumerate())
for attempt in range(3):
    # What Megatron's in-process restart re-runs: initialize_megatron installs a new
    # DistributedSignalHandler (the old one is dropped, not released), then the launcher's
    # install(); the attempt ends with uninstall() (the launcher's hooks leave pretrain).
    megatron_handler = DistributedSignalHandler(signal.SIGTERM).__enter__()
    noted = signal.getsignal(signal.SIGTERM)
    os.makedirs(os.path.join(root, f"attempt{attempt}"), exist_ok=True)  # the drive
    off = install(OffloadConfig(dirs=[os.path.join(root, f"attempt{attempt}")], job="t",
                                min_tensor_bytes=0, keep_last_layers=0))
    assert signal.getsignal(signal.SIGTERM) is cleanup._on_signal
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not megatron_handler._signal_received:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    leaf = torch.randn(8, 512, requires_grad=True)
    with off.microbatch(0):
        out = (leaf * 2.0).relu() * 3.0
    off.wait_writes()
    out.sum().backward()
    stats = off.end_step()
    assert stats.bytes_offloaded > 0 and stats.bytes_read > 0, stats
    uninstall()
    assert installed() is None
    assert signal.getsignal(signal.SIGTERM) is noted, "Megatron's handler is back"
    assert cleanup.registered() == 0 and not cleanup._atexit_registered
    left = sorted(os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files)
    assert left == [os.path.join(root, f"attempt{i}") for i in range(attempt + 1)], left
    left = [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    assert left == [], left
    print("attempt", attempt, "ok", flush=True)
"""


def test_install_after_uninstall_in_one_process_as_in_process_restart_does(tmp_path):
    """Megatron's ``--inprocess-restart`` re-enters training in the same process. Its wrapper
    comes from nvidia-resiliency-ext (not installed here), so the test runs what it re-runs, three times in one process: Megatron's real
    ``DistributedSignalHandler``, ``install()``, a SIGTERM that the handler notes while offload
    goes on, an offloaded step, ``uninstall()``. Each time: our handler is in front of the new
    Megatron handler and hands it the signal, and after ``uninstall()`` Megatron's is back, no
    cleaner, atexit hook, thread or file is left."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-c", RESTARTS, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    attempts = [line for line in proc.stdout.split("\n") if line.startswith("attempt")]
    assert attempts == [f"attempt {i} ok" for i in range(3)], proc.stdout
