"""scripts/slurm_pretrain_gpt.sbatch's multi-node path on a real two-node Slurm cluster.

The cluster (``tests/slurm_cluster.py``, ``nodes=["n1", "n2"]``) runs two slurmd of Debian's
slurm-wlm 22.05 on this host, each in a node of its own (``tests/two_nodes.py``: its own UTS
and mount namespace, so its own hostname, boot id and /etc/hosts) with its own port; one
core each. ``sbatch --nodes=2`` runs the script unmodified on n1; its ``srun`` starts one task
per node, each running scripts/ssdtrain_node.sh with Slurm's SLURM_NODEID / SLURM_NNODES, and
each node's torchrun (one worker: GPUS_PER_NODE=1) meets the other's in a c10d rendezvous at
MASTER_ADDR=n1 (the first host of the job's node list, as the script picks it) under the job
id. The workers run the tiny ``pretrain_gpt.py`` of tests/test_slurm.py (megatron-core on CPU,
gloo) through ``python -m ssdtrain_megatron.launch --ssd-offload``; offload roots are per-node
folders of the shared disk (``{hostname}`` in SSD_DIRS: node-local drives), and each node's
script removes its own job folder at the end.

Break it: in scripts/ssdtrain_node.sh, take the ``--standalone`` branch whatever NNODES is:
each node then trains a world of its own whose rank 0 logs, and the test fails on the number
of "lm loss:" lines ("assert 6 == 3"); past that, both stats files would say rank 0.

Skipped, with the reason, where Slurm is not installed or namespaces cannot be made (not
root); with SSDTRAIN_CI_REQUIRE_SLURM=1 (.ci/run, once Slurm is installed) a cluster that
cannot start fails the test instead.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("megatron.core")

import slurm_cluster  # noqa: E402
import two_nodes  # noqa: E402
from test_slurm import SBATCH, _cannot_run, job_folder  # noqa: E402

NODES = ["n1", "n2"]
# What `sbatch` overrides on this cluster: two nodes of one core, no GPUs as gres.
OVERRIDES = ["--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=00:10:00"]
JOB_TIMEOUT_S = 420  # ~1 min on two idle cores


@pytest.fixture(scope="module")
def cluster():
    why = slurm_cluster.unavailable() or two_nodes.namespaces_refused()
    if why:
        _cannot_run(why)
    c = slurm_cluster.SlurmCluster(cpus=2, nodes=NODES)
    try:
        c.start()
    except Exception as exc:
        c.stop()
        _cannot_run(f"the two-node test Slurm cluster did not start: {exc}")
    try:
        yield c
    finally:
        left = c.stop()
        assert left == [], f"processes of the test cluster survived it: {left}"


def _left_under(tmp_path) -> list:
    """Everything below each node's drive folders (tmp_path/n1, tmp_path/n2)."""
    return sorted(os.path.relpath(os.path.join(d, n), tmp_path)
                  for host in NODES for d, dirs, files in os.walk(tmp_path / host)
                  for n in dirs + files)


def test_sbatch_script_trains_on_two_nodes_with_one_srun_task_each(cluster, tmp_path):
    env = job_folder(tmp_path)
    env.update(GPUS_PER_NODE="1", SSD_DIRS=f"{tmp_path}/{{hostname}}/nvme{{local_rank}}/ssdtrain/{{job}}")
    for host in NODES:  # each node's drive, mounted, with the folder above {job} on it
        os.makedirs(tmp_path / host / "nvme0" / "ssdtrain")
    stats = f"{tmp_path}/stats-{{hostname}}-{{rank}}.jsonl"
    job = cluster.sbatch(*OVERRIDES, f"--output={tmp_path}/%x-%j.out", SBATCH,
                         "--train-iters", "3", "--ssd-offload-stats-path", stats,
                         cwd=str(tmp_path), env=env)
    info = cluster.wait(job, timeout=JOB_TIMEOUT_S)
    with open(f"{tmp_path}/ssdtrain-pretrain-{job}.out") as fh:
        output = fh.read()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-5000:]
    assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2", info
    assert output.count("lm loss:") == 3, output[-5000:]  # rank 0 logs; one world of two
    found = {}
    for name in os.listdir(tmp_path):
        m = re.fullmatch(r"stats-(\w+)-(\d+)\.jsonl", name)
        if m:
            found[(m.group(1), int(m.group(2)))] = tmp_path / name
    # One worker on each node, ranks 0 and 1 of one world (c10d assigns which is which).
    assert sorted(host for host, _ in found) == NODES, sorted(found)
    assert sorted(rank for _, rank in found) == [0, 1], sorted(found)
    for key, path in found.items():
        with open(path) as fh:
            steps = [r for r in (json.loads(line) for line in fh if line.strip())
                     if "run" not in r]  # each run (and rank) starts with a header line
        assert len(steps) == 3, (key, steps)
        assert all(s["bytes_offloaded"] > 0 and s["bytes_on_disk"] == 0 for s in steps), (key, steps)
        assert sum(s["bytes_read"] for s in steps) > 0, (key, steps)
    # Each node removed its own job folder; the drives' folders above {job} stay.
    assert _left_under(tmp_path) == sorted([f"{h}/nvme0" for h in NODES]
                                           + [f"{h}/nvme0/ssdtrain" for h in NODES]), output[-3000:]


def test_sbatch_stops_in_one_line_when_one_nodes_drive_is_missing(cluster, tmp_path):
    """n1 has its drive, n2 has not. The script's pre-flight (`ssdtrain doctor --preflight` on
    each node, one srun task per node) stops the job before any node starts torchrun: the
    output's first line is n2's, naming the node, its local rank, the root and the fix; n1
    says nothing; no worker starts. Broken variant (the sbatch's pre-flight `if` dropped): the
    workers start, n2's refuse the root, torchrun stops n1's (signal 15): the job ends FAILED
    with exit code 1:0, not 2:0 ("srun: error: n1: task 0: Exited with exit code 1")."""
    env = job_folder(tmp_path)
    template = f"{tmp_path}/{{hostname}}/nvme{{local_rank}}/ssdtrain/{{job}}"
    env.update(GPUS_PER_NODE="1", SSD_DIRS=template)
    os.makedirs(tmp_path / "n1" / "nvme0" / "ssdtrain")  # n2's drive is not mounted
    job = cluster.sbatch(*OVERRIDES, f"--output={tmp_path}/%x-%j.out", SBATCH, "--train-iters", "3",
                         cwd=str(tmp_path), env=env)
    info = cluster.wait(job, timeout=JOB_TIMEOUT_S)
    with open(f"{tmp_path}/ssdtrain-pretrain-{job}.out") as fh:
        output = fh.read()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, output[-3000:])
    lines = output.splitlines()
    assert lines[0] == (
        f"ssdtrain doctor: error: node n2, local rank 0: offload root {tmp_path}/n2/nvme0/ssdtrain "
        f"(dirs[0] {template!r}) does not exist: mount the drive or create it; we create only our "
        "job and rank folders below a root (--ssd-offload-create-dirs / create_dirs: true creates "
        "it anyway)"), output[-3000:]
    assert sum("ssdtrain doctor: error:" in line for line in lines) == 1  # n1 passed, silently
    assert lines[-1].startswith("slurm_pretrain_gpt: pre-flight failed on the node(s) named above")
    for never in ("ssdtrain-pretrain", "torch.distributed", "lm loss", "Traceback"):
        assert never not in output, (never, output[-3000:])
    assert _left_under(tmp_path) == ["n1/nvme0", "n1/nvme0/ssdtrain"]
