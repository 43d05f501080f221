"""The pre-flight where users meet it: the real launcher under torchrun (2 worker processes,
CPU) and scripts/pretrain_gpt_single_node.sh, each given a missing root, a file as root, a root
on the filesystem of /, and a bad preset. Each must end with a non-zero exit status, our one
line first on stderr (naming the node, the rank, the path and the fix), and no sign that
Megatron was even imported.

Megatron-LM is a stand-in folder here: its ``megatron/__init__.py`` and ``pretrain_gpt.py``
print markers, so that any import of megatron or any start of the script shows in the output
(the positive controls check that the markers do appear once the settings are right). The
multi-node sbatch case is in tests/test_slurm_two_nodes.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from ssdtrain_megatron.io.roots import on_system_disk

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINGLE = os.path.join(REPO, "scripts", "pretrain_gpt_single_node.sh")
HOST = socket.gethostname()
IMPORTED, STARTED = "MEGATRON IMPORTED", "PRETRAIN_GPT STARTED"
TIMEOUT_S = 180

TINY_PRESET = """\
model: {num_layers: 2, hidden: 32, heads: 4, ffn_hidden: 64, seq_len: 16, micro_batch: 2, vocab: 64}
parallel: {tp: 1, pp: 1}
offload: {dirs: ["/nonexistent/overridden/{job}"], io_threads: %s}
"""


@pytest.fixture
def job(tmp_path):
    """A stand-in Megatron-LM checkout, the two presets, and the environment (no pre-flight
    skip, one OpenMP thread so that torchrun says nothing before the workers)."""
    mlm = tmp_path / "Megatron-LM"
    (mlm / "megatron" / "training").mkdir(parents=True)
    (mlm / "megatron" / "__init__.py").write_text(f"import sys\nprint({IMPORTED!r}, file=sys.stderr)\n")
    (mlm / "megatron" / "training" / "__init__.py").write_text("")
    (mlm / "megatron" / "training" / "arguments.py").write_text(
        "def parse_args(extra_args_provider=None, ignore_unknown_args=False):\n    pass\n")
    (mlm / "megatron" / "training" / "initialize.py").write_text(
        "def initialize_megatron(*args, **kwargs):\n    pass\n")
    (mlm / "pretrain_gpt.py").write_text(f"import megatron\nprint({STARTED!r}, flush=True)\n")
    (tmp_path / "good.yaml").write_text(TINY_PRESET % 2)
    (tmp_path / "bad.yaml").write_text(TINY_PRESET % 0)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SSDTRAIN", "MEGATRON_ARGS", "TORCHELASTIC"))}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHON=sys.executable, MEGATRON_LM=str(mlm),
               GPUS_PER_NODE="2", MEGATRON_ARGS="")
    return tmp_path, env


@pytest.fixture(scope="module")
def system_dir():
    """A folder on the filesystem of / (skips where /var/tmp is not on it)."""
    d = tempfile.mkdtemp(prefix="ssdtrain-preflight-", dir="/var/tmp")
    try:
        if not on_system_disk(d):
            pytest.skip("/var/tmp is not on the filesystem of / here")
        os.mkdir(os.path.join(d, "ssdtrain"))
        yield d
    finally:
        shutil.rmtree(d)


def _allow(tmp_path) -> list:
    return ["--ssd-offload-allow-system-disk"] if on_system_disk(str(tmp_path)) else []


def _case(name: str, tmp_path, system_dir: str):
    """(dirs template, extra flags, preset, what our line must say) of each case."""
    (tmp_path / "a-file").write_text("not a folder")
    allow = _allow(tmp_path)
    root = f"{tmp_path}/nvme{{local_rank}}/ssdtrain"
    return {
        "missing root": (f"{root}/{{job}}", allow, "good.yaml",
                         f"offload root {tmp_path}/nvme@R@/ssdtrain (dirs[0] '{root}/{{job}}') "
                         "does not exist: mount the drive or create it"),
        "file as root": (f"{tmp_path}/a-file/{{job}}", allow, "good.yaml",
                         f"offload root {tmp_path}/a-file (dirs[0] '{tmp_path}/a-file/{{job}}') is not "
                         "a directory: point --ssd-offload-dir (dirs) at a directory"),
        "root on /": (f"{system_dir}/ssdtrain/{{job}}", [], "good.yaml",
                      f"offload root {system_dir}/ssdtrain is on the filesystem of / ("),
        "bad preset": (f"{root}/{{job}}", allow, "bad.yaml",
                       "argument --ssd-offload-config: OffloadConfig.io_threads=0 is invalid: "
                       "expected an integer >= 1"),
    }[name]


# The cases that each of the two checks itself (tests/test_preflight.py) runs in the default
# suite; the other two, which take the same path to our line, only with -m slow.
CASES = ["missing root", "bad preset", pytest.param("file as root", marks=pytest.mark.slow),
         pytest.param("root on /", marks=pytest.mark.slow)]


def _assert_stopped_before_megatron(out: subprocess.CompletedProcess, prefix: str, says: str) -> None:
    assert out.returncode != 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines and lines[0].startswith(prefix), out.stderr[-3000:]
    assert says in lines[0], (says, lines[0])
    assert IMPORTED not in out.stdout + out.stderr and STARTED not in out.stdout + out.stderr


@pytest.mark.parametrize("case", CASES)
def test_the_launcher_under_torchrun_stops_each_worker_in_one_line_before_megatron(job, system_dir, case):
    """Broken variant (launch.main without the pre-flight): both workers import the stand-in
    and start the script, which (a stand-in) never reaches install(): "assert 0 != 0", the
    output "MEGATRON IMPORTED" twice."""
    tmp_path, env = job
    template, extra, preset, says = _case(case, tmp_path, system_dir)
    if case == "missing root":
        # Only rank 1's drive is missing: rank 0 must not go on into Megatron either.
        (tmp_path / "nvme0" / "ssdtrain").mkdir(parents=True)
        says = says.replace("@R@", "1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ssdtrain_megatron.launch", str(tmp_path / "Megatron-LM" / "pretrain_gpt.py"),
         "--num-layers", "2", "--ssd-offload", "--ssd-offload-config", str(tmp_path / preset),
         "--ssd-offload-dir", template, *extra],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    rank = r"1 \(local rank 1\)" if case == "missing root" else r"[01] \(local rank [01]\)"
    _assert_stopped_before_megatron(out, f"ssdtrain-pretrain: error: node {HOST}, rank ", says)
    import re

    assert re.match(rf"ssdtrain-pretrain: error: node {re.escape(HOST)}, rank {rank}: ", out.stderr)


def test_with_the_settings_right_the_launcher_runs_the_script(job):
    """The positive control of the markers above (one process: the launcher without torchrun)."""
    tmp_path, env = job
    (tmp_path / "ssd").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "ssdtrain_megatron.launch", str(tmp_path / "Megatron-LM" / "pretrain_gpt.py"),
         "--ssd-offload", "--ssd-offload-config", str(tmp_path / "good.yaml"),
         "--ssd-offload-dir", f"{tmp_path}/ssd/{{job}}", *_allow(tmp_path)],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert IMPORTED in out.stderr and out.stdout.strip() == STARTED


def _single_node(tmp_path, env, template: str, preset: str, extra) -> subprocess.CompletedProcess:
    env = dict(env, SSD_DIRS=template, PRESET=str(tmp_path / preset))
    return subprocess.run(["bash", SINGLE, *extra], env=env, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("case", CASES)
def test_the_single_node_script_stops_in_one_line_before_torchrun(job, system_dir, case):
    """Broken variant (the pre-flight call removed from pretrain_gpt_single_node.sh): torchrun
    starts and each worker's launcher reports instead; the first line is then
    "ssdtrain-pretrain: error: node vm, rank 1 ...", not the node's "ssdtrain doctor: error:"."""
    tmp_path, env = job
    template, extra, preset, says = _case(case, tmp_path, system_dir)
    if case == "missing root":
        says = says.replace("@R@", "0")  # neither drive: the first problem is local rank 0's
    out = _single_node(tmp_path, env, template, preset, extra)
    prefix = f"ssdtrain doctor: error: node {HOST}, local rank"
    if case == "bad preset":
        prefix = f"ssdtrain doctor: error: node {HOST}: "
    _assert_stopped_before_megatron(out, prefix, says)
    assert out.returncode == 2


def test_with_the_settings_right_the_single_node_script_trains(job):
    """Its positive control: torchrun starts both workers, each runs the script. (That
    SSDTRAIN_SKIP_PREFLIGHT=1 skips the check: tests/test_scripts.py.)"""
    tmp_path, env = job
    for r in (0, 1):
        (tmp_path / f"nvme{r}" / "ssdtrain").mkdir(parents=True)
    out = _single_node(tmp_path, env, f"{tmp_path}/nvme{{local_rank}}/ssdtrain/{{job}}", "good.yaml",
                       _allow(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(STARTED) == 2 and out.stderr.count(IMPORTED) == 2
