"""scripts/: every script parses (`bash -n`), marks the lines a user edits, and the per-node
runner passes the preset through, fills in the offload roots and removes the job's offload
directories on exit, on failure and on SIGTERM (scancel). `python` and `srun` are stand-ins
here: they record their arguments instead of training. The scripts' pre-flight (`ssdtrain
doctor --preflight`, run by the real python) is off here (SSDTRAIN_SKIP_PREFLIGHT=1) but in
the tests that say so; tests/test_preflight_launch.py runs it for real."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")
NODE = os.path.join(SCRIPTS, "ssdtrain_node.sh")
SBATCH = os.path.join(SCRIPTS, "slurm_pretrain_gpt.sbatch")
SINGLE = os.path.join(SCRIPTS, "pretrain_gpt_single_node.sh")
PRESET = os.path.join(REPO, "configs", "llama3-70b.yaml")

SHELL_SCRIPTS = sorted(f for f in os.listdir(SCRIPTS) if f.endswith((".sh", ".sbatch")))


def test_scripts_folder_has_the_launch_scripts():
    assert {"slurm_pretrain_gpt.sbatch", "pretrain_gpt_single_node.sh", "ssdtrain_node.sh",
            "demo.sh", "apply_patches.sh"} <= set(SHELL_SCRIPTS)


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_script_parses_and_is_executable(name):
    path = os.path.join(SCRIPTS, name)
    out = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert os.stat(path).st_mode & stat.S_IXUSR


@pytest.mark.parametrize("path, edited", [
    (SBATCH, ["#SBATCH --nodes=", "#SBATCH --gpus-per-node=", "#SBATCH --cpus-per-task=",
              "#SBATCH --time=", "MEGATRON_LM=", "PRESET=", "SSD_DIRS=", "PYTHON=",
              "GPUS_PER_NODE=", "MEGATRON_ARGS="]),
    (SINGLE, ["#SBATCH --gpus-per-node=", "#SBATCH --cpus-per-task=", "MEGATRON_LM=", "PRESET=",
              "SSD_DIRS=", "PYTHON=", "GPUS_PER_NODE=", "MEGATRON_ARGS="]),
    (os.path.join(SCRIPTS, "demo.sh"), ["DEMO_DIR="]),
])
def test_lines_a_user_edits_are_marked(path, edited):
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for start in edited:
        i = next(n for n, line in enumerate(lines) if line.lstrip().startswith(start)
                 or line.startswith("[[ -n \"${" + start.rstrip("=")))
        # The EDIT mark is on the line itself or on the comment line right above it.
        assert "EDIT" in lines[i] or "EDIT" in lines[i - 1], (path, lines[i])


# -- the per-node runner, with a stand-in python ---------------------------------------------


@pytest.fixture
def stand_ins(tmp_path):
    """A `python` that records its arguments (and delegates `-m ...megatron.args` and the
    `ssdtrain` command, `-m ssdtrain_megatron.tools`, unless STUB_PREFLIGHT_LOG asks it to
    record that too and exit STUB_PREFLIGHT_EXIT), a `srun` that runs its command once, a
    `scontrol` that names one node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(
        "#!/bin/bash\n"
        "if [[ \"$1 $2\" == '-m ssdtrain_megatron.tools' && -n \"${STUB_PREFLIGHT_LOG:-}\" ]]; then\n"
        "    printf '%s\\n' \"$@\" > \"$STUB_PREFLIGHT_LOG\"\n"
        "    exit \"${STUB_PREFLIGHT_EXIT:-0}\"\n"
        "fi\n"
        "if [[ \"$1 $2\" == '-m ssdtrain_megatron.megatron.args' || \"$1 $2\" == '-m ssdtrain_megatron.tools' ]]; then\n"
        f"    exec {sys.executable} \"$@\"\n"
        "fi\n"
        "printf '%s\\n' \"$@\" > \"$STUB_LOG\"\n"
        "mkdir -p \"$STUB_WRITES/rank0\" && touch \"$STUB_WRITES/rank0/slab.bin\"\n"
        "[[ -n \"${STUB_SLEEP:-}\" ]] && exec sleep \"$STUB_SLEEP\"\n"
        "exit \"${STUB_EXIT:-0}\"\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        "while [[ \"$1\" == --* ]]; do shift; done\n"
        "exec \"$@\"\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        "if [[ \"$1 $2\" == 'show job' ]]; then\n"
        "    echo \"   Command=${STUB_SUBMITTED:-(null)} --some-arg\"\n"
        "else\n"
        "    echo node-a\n"
        "fi\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    nvme = tmp_path / "mnt"
    (tmp_path / "Megatron-LM").mkdir()
    (tmp_path / "Megatron-LM" / "pretrain_gpt.py").write_text("# stand-in\n")
    env = dict(os.environ)
    for name in ("SSDTRAIN", "MEGATRON_ARGS", "SLURM_JOB_ID", "SLURM_SUBMIT_DIR"):
        env.pop(name, None)
    env.update({
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "PYTHON": str(bin_dir / "python"),
        "MEGATRON_LM": str(tmp_path / "Megatron-LM"), "PRESET": PRESET,
        "SSD_DIRS": f"{nvme}/nvme{{local_rank}}/ssdtrain/{{job}}", "GPUS_PER_NODE": "2",
        "JOB_ID": "4242", "STUB_LOG": str(tmp_path / "argv.txt"),
        "STUB_WRITES": f"{nvme}/nvme1/ssdtrain/4242", "SSDTRAIN_SKIP_PREFLIGHT": "1"})
    # Another job's directory on the same drive: must survive.
    (nvme / "nvme0" / "ssdtrain" / "1111").mkdir(parents=True)
    return env, tmp_path


def _argv(tmp_path) -> list:
    return (tmp_path / "argv.txt").read_text().splitlines()


def _job_dirs(tmp_path) -> list:
    root = tmp_path / "mnt"
    return sorted(str(p.relative_to(root)) for p in root.glob("nvme*/ssdtrain/*"))


def test_node_runner_passes_preset_and_roots_through_and_cleans_up(stand_ins):
    env, tmp_path = stand_ins
    out = subprocess.run(["bash", NODE, "--data-path", "/data/x"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = _argv(tmp_path)
    assert argv[:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m"]
    assert argv[6:8] == ["ssdtrain_megatron.launch", f"{tmp_path}/Megatron-LM/pretrain_gpt.py"]
    assert argv[argv.index("--tensor-model-parallel-size") + 1] == "8"  # from the preset
    assert argv[argv.index("--data-path") + 1] == "/data/x"               # passed through
    assert argv[-7:] == ["--ssd-offload", "--ssd-offload-config", PRESET, "--ssd-offload-dir",
                         env["SSD_DIRS"], "--ssd-offload-job", "4242"]
    assert _job_dirs(tmp_path) == ["nvme0/ssdtrain/1111"]


def test_node_runner_cleans_up_after_a_failure_and_keeps_its_status(stand_ins):
    env, tmp_path = stand_ins
    env["STUB_EXIT"] = "3"
    out = subprocess.run(["bash", NODE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert _job_dirs(tmp_path) == ["nvme0/ssdtrain/1111"]


def test_node_runner_cleans_up_when_cancelled(stand_ins):
    env, tmp_path = stand_ins
    env["STUB_SLEEP"] = "60"
    proc = subprocess.Popen(["bash", NODE], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        slab = tmp_path / "mnt" / "nvme1" / "ssdtrain" / "4242" / "rank0" / "slab.bin"
        while not slab.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slab.exists()
        time.sleep(0.2)  # let the stand-in reach its sleep
        proc.send_signal(signal.SIGTERM)  # what scancel and the time limit send
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _job_dirs(tmp_path) == ["nvme0/ssdtrain/1111"]


def test_node_runner_refuses_roots_without_the_job(stand_ins):
    env, tmp_path = stand_ins
    env["SSD_DIRS"] = f"{tmp_path}/mnt/nvme{{local_rank}}"
    out = subprocess.run(["bash", NODE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "must be an absolute path containing {job}" in out.stderr
    assert not (tmp_path / "argv.txt").exists()


def _slurm_env(env):
    env.update({"SLURM_NNODES": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-a"})
    del env["JOB_ID"]
    return env


def test_sbatch_script_runs_the_node_runner_on_every_node(stand_ins):
    env, tmp_path = stand_ins
    env = _slurm_env(env)
    env["STUB_SUBMITTED"] = "/bin/bash"  # as in an salloc allocation: the script's own folder wins
    out = subprocess.run(["bash", SBATCH, "--data-path", "/data/x", "--train-iters", "7"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = _argv(tmp_path)
    assert argv[argv.index("--ssd-offload-job") + 1] == "4242"
    assert argv[argv.index("--ssd-offload-config") + 1] == PRESET
    assert "--tokenizer-model" in argv  # the script's MEGATRON_ARGS
    # The flags after the script reach Megatron, after the script's own (the last one wins).
    assert argv[argv.index("--data-path") + 1] == "/data/x"
    last = len(argv) - 1 - argv[::-1].index("--train-iters")
    assert argv[last + 1] == "7" and argv.index("--train-iters") < last
    assert _job_dirs(tmp_path) == ["nvme0/ssdtrain/1111"]


@pytest.mark.parametrize("script", [SBATCH, SINGLE], ids=["sbatch", "single-node"])
def test_launch_scripts_find_the_project_from_the_submitted_path_when_sbatch_runs_a_copy(stand_ins, script):
    """sbatch runs a copy of the script from slurmd's spool folder: the project is found from
    the path the job was submitted with (scontrol show job: Command=), not from the copy."""
    env, tmp_path = stand_ins
    env = _slurm_env(env)
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    copy = spool / "slurm_script"
    copy.write_text(open(script).read())
    env["STUB_SUBMITTED"] = script
    out = subprocess.run(["bash", str(copy), "--train-iters", "3"], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--train-iters" in _argv(tmp_path)
    env.pop("STUB_SUBMITTED")  # no way to find it: one line, exit 2
    out = subprocess.run(["bash", str(copy)], env=env, cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "no scripts/ssdtrain_node.sh in SSDTRAIN=" in out.stderr and "set SSDTRAIN" in out.stderr


@pytest.mark.parametrize("script", [SBATCH, SINGLE], ids=["sbatch", "single-node"])
def test_megatron_args_from_the_environment_replace_the_scripts_own(stand_ins, script):
    env, tmp_path = stand_ins
    env = _slurm_env(env)
    env["MEGATRON_ARGS"] = "--num-layers 2  --mock-data"
    out = subprocess.run(["bash", script, "--seq-length", "64"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = _argv(tmp_path)
    assert "--tokenizer-type" not in argv and "--lr" not in argv  # the defaults are replaced
    i = argv.index("--mock-data")
    assert argv[i - 2:i + 3] == ["--num-layers", "2", "--mock-data", "--seq-length", "64"]
    env["MEGATRON_ARGS"] = ""  # set but empty: no defaults at all
    out = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--lr" not in _argv(tmp_path)


@pytest.mark.parametrize("what, message", [
    ("PRESET", "ssdtrain_node: PRESET={value}: no such file"),
    ("MEGATRON_LM", "ssdtrain_node: MEGATRON_LM={value} has no pretrain_gpt.py"),
])
def test_node_runner_stops_on_a_missing_preset_or_checkout_before_torchrun(stand_ins, what, message):
    env, tmp_path = stand_ins
    env[what] = str(tmp_path / "nope")
    out = subprocess.run(["bash", NODE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == next(line for line in out.stderr.splitlines() if line)  # one line
    assert out.stderr.startswith(message.format(value=env[what]))
    assert not (tmp_path / "argv.txt").exists()  # torchrun never started


def test_node_runner_stops_on_a_preset_it_cannot_read(stand_ins):
    env, tmp_path = stand_ins
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {num_layers: -1}\n")
    env["PRESET"] = str(bad)
    out = subprocess.run(["bash", NODE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "cannot turn PRESET=" in out.stderr
    assert not (tmp_path / "argv.txt").exists()


@pytest.mark.parametrize("script", [SBATCH, SINGLE], ids=["sbatch", "single-node"])
def test_cluster_specific_sbatch_lines_are_named_with_what_goes_wrong(script):
    with open(script, encoding="utf-8") as fh:
        text = fh.read()
    for said in ("Invalid generic resource (gres) specification", "PartitionConfig",
                 "override them on the sbatch command line"):
        assert said in text, said
    with open(os.path.join(REPO, "docs", "cluster.md"), encoding="utf-8") as fh:
        readme = fh.read()  # the cluster docs, linked from the README
    assert "Invalid generic resource (gres) specification" in readme and "PartitionConfig" in readme
    assert "MEGATRON_ARGS=(" not in readme  # bash cannot export arrays: the docs say a string


def test_single_node_script_runs_the_node_runner(stand_ins):
    env, tmp_path = stand_ins
    del env["JOB_ID"]
    env.pop("SLURM_JOB_ID", None)
    out = subprocess.run(["bash", SINGLE, "--train-iters", "5"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = _argv(tmp_path)
    assert argv[argv.index("--ssd-offload-job") + 1].startswith("local-")
    assert argv[argv.index("--train-iters", argv.index("--train-iters") + 1) + 1] == "5"


@pytest.mark.parametrize("script", [SBATCH, SINGLE], ids=["sbatch", "single-node"])
def test_launch_scripts_run_the_preflight_with_the_workers_arguments_before_torchrun(stand_ins, script):
    """The node's pre-flight is `ssdtrain doctor --preflight` for its local ranks, given exactly
    what each worker's launcher will get; a failing one stops the script (exit 2) before
    torchrun; SSDTRAIN_SKIP_PREFLIGHT=1 skips it. Broken variant (the sbatch's pre-flight
    `if` dropped): "FileNotFoundError: .../preflight.txt"."""
    env, tmp_path = stand_ins
    env = _slurm_env(env)
    del env["SSDTRAIN_SKIP_PREFLIGHT"]
    checked = tmp_path / "preflight.txt"
    env["STUB_PREFLIGHT_LOG"] = str(checked)
    out = subprocess.run(["bash", script, "--data-path", "/data/x"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = checked.read_text().splitlines()
    assert argv[:9] == ["-m", "ssdtrain_megatron.tools", "doctor", "--preflight", "--nproc-per-node",
                        "2", "--node-rank", "0", "--"]
    launcher = _argv(tmp_path)
    assert argv[9:] == launcher[launcher.index(f"{tmp_path}/Megatron-LM/pretrain_gpt.py") + 1:]
    # A failing node: the script stops with the pre-flight's status, torchrun never starts.
    checked.unlink()
    (tmp_path / "argv.txt").unlink()
    env["STUB_PREFLIGHT_EXIT"] = "2"
    out = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and checked.exists() and not (tmp_path / "argv.txt").exists()
    if script == SBATCH:
        assert out.stderr.splitlines()[-1].startswith("slurm_pretrain_gpt: pre-flight failed on the "
                                                      "node(s) named above")
    # Skipped: no check, torchrun starts.
    checked.unlink()
    env["SSDTRAIN_SKIP_PREFLIGHT"] = "1"
    out = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not checked.exists() and (tmp_path / "argv.txt").exists()
