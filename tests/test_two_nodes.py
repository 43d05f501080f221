"""A two-node job on one machine: megatron-core GPT with TP=2 across two nodes, through install().

Two torchrun agents (``--nnodes 2``, node ranks 0 and 1, c10d rendezvous on 127.0.0.1 with
``--rdzv-id`` as scripts/ssdtrain_node.sh passes it), one worker each (this machine has two
cores), each agent in a node of its own (``tests/two_nodes.py``: its own UTS and mount
namespace, so its own hostname and boot id) and both on one shared disk. The workers train
``megatron_harness``' tiny GPT split by tensor parallelism over the two nodes (gloo), plain and
then with install(), offloading to two roots whose templates give one a shared folder
(``{root}/shared/{job}``) and the other a per-node one
(``{root}/{hostname}/nvme{local_rank}/{job}``); each rank writes its stats to
``{hostname}.rank{rank}.local{local_rank}.{job}.jsonl``.

In iteration 1, with activations on disk, both ranks wait; meanwhile a dead process of each
node has left a rank directory in the shared folder, and ``ssdtrain clean`` runs on node1 (in
its namespaces, nsenter) over the whole offload root. It must remove node1's dead directory
and nothing else: not node0's live job directories (their owner.json is locked; here both
nodes share one kernel, so node1 sees the lock and reports them live; on real machines a lock
may not cross a shared filesystem, and another boot id makes them "cannot tell"), nor node0's
dead one, which only node0 can judge (another boot id, changed since this boot: "cannot
tell"). After the job, ``ssdtrain clean`` on node0 removes that one.

Break it: in ``io/owner.py`` ``judge_owner``, take another boot id as "the node rebooted, so
the job is gone" (main's rule): the clean on node1 removes node0's dead directory, and
test_clean_on_one_node_never_touches_the_other_nodes_job fails. Expand
``{hostname}`` to "localhost" in ``layout.expand_root`` and the per-node directory test fails;
in ``layout.expand_file``, and the stats file test does; flip one bit of every posix read and
the bitwise test does.

Skipped, with the reason, where namespaces cannot be made (not root, or unshare refused).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Dict, List, Optional

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("megatron.core")

import megatron_harness as harness  # noqa: E402
import two_nodes  # noqa: E402
from megatron_harness import LAYOUTS, Phase  # noqa: E402
from ranks import REPO, free_port  # noqa: E402

_REFUSED = two_nodes.namespaces_refused()
pytestmark = pytest.mark.skipif(_REFUSED is not None, reason=str(_REFUSED))

NODES = ("node0", "node1")
JOB = "job42"  # torchrun's --rdzv-id: the {job} of both nodes (TORCHELASTIC_RUN_ID)
OFFLOAD = dict(dirs=["{root}/shared/{job}", "{root}/{hostname}/nvme{local_rank}/{job}"],
               stats_path="{workdir}/stats/{hostname}.rank{rank}.local{local_rank}.{job}.jsonl",
               policy="offload", min_tensor_bytes=0)
RUN_TIMEOUT_S = 600  # the job takes ~1 min on two idle cores; generous for a loaded CI box
DEAD_RANK = 9  # the rank directory a dead process of each node leaves in the shared folder

PLANT = """
import os, socket, sys
from ssdtrain_megatron.io.layout import Identity, make_rank_dir
d = make_rank_dir(sys.argv[1], Identity(rank=%d, local_rank=0, hostname=socket.gethostname(),
                                        job="deadjob"))
with open(os.path.join(d, "slab.0"), "wb") as fh:
    fh.write(b"x" * 8192)
print(d)
""" % DEAD_RANK


def _env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([REPO, HERE] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _tree(root: str) -> Dict[str, tuple]:
    """Every folder and file under ``root``: (inode, size) by path relative to it."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_ino, st.st_size)
    return out


def _wait(cond, nodes: List[two_nodes.Node], what: str) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not cond():
        failed = [n.name for n in nodes if n.proc.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"waiting for {what}: " + (f"{failed} failed" if failed else "timed out"))
        time.sleep(0.1)


class TwoNodeJob:
    """What the job and the sweeps around it left behind, for the tests below."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.root = os.path.realpath(os.path.join(workdir, "offload_root"))
        self.pause = os.path.join(workdir, "pause")
        os.makedirs(self.pause)
        for node in NODES:  # the drives, mounted: the shared one and each node's own
            os.makedirs(os.path.join(self.root, "shared"), exist_ok=True)
            os.makedirs(os.path.join(self.root, node, "nvme0"), exist_ok=True)
        self.nodes = [two_nodes.Node(n, os.path.join(workdir, "nodes"), NODES) for n in NODES]
        self.planted: Dict[str, str] = {}
        self.logs = {n.name: os.path.join(workdir, f"{n.name}.log") for n in self.nodes}
        self.failure: Optional[str] = None

    def run(self) -> None:
        spec = dataclasses.replace(LAYOUTS["tp2"], timeout_s=RUN_TIMEOUT_S, phases=[
            Phase("plain"), Phase("offload", offload=OFFLOAD, pause=self.pause)])
        spec_path = os.path.join(self.workdir, "spec.json")
        with open(spec_path, "w") as fh:
            fh.write(spec.to_json())
        port = free_port()
        for rank, node in enumerate(self.nodes):
            node.start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                        "--node-rank", str(rank), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", JOB,
                        # megatron_harness' worker, imported (not __main__: its results unpickle)
                        "--no-python", sys.executable, "-c",
                        "import megatron_harness as h; h._worker_main()", spec_path, self.workdir],
                       _env(), self.logs[node.name], REPO)
        try:
            _wait(lambda: all(os.path.exists(os.path.join(self.pause, f"paused.{r}")) for r in (0, 1)),
                  self.nodes, "both ranks to reach the pause with activations on disk")
            self._sweep_while_live()
        finally:
            open(os.path.join(self.pause, "resume"), "w").close()
        try:
            _wait(lambda: all(n.proc.poll() is not None for n in self.nodes), self.nodes, "the job to end")
            codes = [n.proc.returncode for n in self.nodes]
            if codes != [0, 0]:
                raise RuntimeError(f"the nodes exited {codes}")
        except RuntimeError as exc:  # the sweep's tests still have what they look at
            self.failure = f"the two-node job failed after the pause: {exc}\n{self.log_tails()}"
            return
        self.results = [torch.load(os.path.join(self.workdir, f"result{r}.pt"), weights_only=False)
                        for r in (0, 1)]
        self.after_job = _tree(self.root)
        self.clean_node0 = self.nodes[0].run([sys.executable, "-m", "ssdtrain_megatron.tools.cli",
                                              "clean", self.root], _env(), 300)
        self.after_clean_node0 = _tree(self.root)

    def finished(self) -> list:
        """The ranks' results; fails with the nodes' logs if the job did not end well."""
        assert self.failure is None, self.failure
        return self.results

    def _sweep_while_live(self) -> None:
        shared = os.path.join(self.root, "shared", "deadjob")
        for node in self.nodes:
            done = node.run([sys.executable, "-c", PLANT, shared], _env(), 300)
            assert done.returncode == 0, done.stderr
            self.planted[node.name] = done.stdout.strip()
        self.before_clean = _tree(self.root)
        self.clean_node1 = self.nodes[1].run([sys.executable, "-m", "ssdtrain_megatron.tools.cli",
                                              "clean", self.root], _env(), 300)
        self.after_clean = _tree(self.root)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def log_tails(self) -> str:
        """Each node's worker lines (torchrun prefixes them with [rankN]) and its last lines."""
        out = []
        for name, path in self.logs.items():
            with open(path) as fh:
                lines = fh.read().splitlines()
            worker = [line for line in lines if line.startswith("[rank")][-40:]
            out.append(f"--- {name}\n" + "\n".join(worker + ["..."] + lines[-30:]))
        return "\n".join(out)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> TwoNodeJob:
    job = TwoNodeJob(str(tmp_path_factory.mktemp("two_nodes")))
    try:
        job.run()
    except Exception as exc:
        raise RuntimeError(f"the two-node job failed: {exc}\n{job.log_tails()}") from exc
    finally:
        job.stop()
    return job


def _host_of(result) -> str:
    """The node a rank ran on: the host part of its rank directory names."""
    hosts = {os.path.basename(d).split(".")[2] for d in result.phases["offload"].offload["rank_dirs"]}
    assert len(hosts) == 1, hosts
    return hosts.pop()


def test_tensor_parallel_across_two_nodes_is_bitwise_equal_and_reads_back(job):
    assert sorted(_host_of(r) for r in job.finished()) == list(NODES)
    for r in job.finished():
        assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == [], r.rank
        steps = r.phases["offload"].offload["steps"]
        assert all(s["bytes_offloaded"] > 0 for s in steps), (r.rank, steps)
        # Read back from the disk: surely in iteration 1, whose writes the pause waited for; in
        # the others, writes still queued at backward are taken back instead (IO timing).
        assert sum(s["bytes_read"] for s in steps) > 0, (r.rank, steps)


def test_rank_directories_are_per_node_per_rank_and_never_collide(job):
    """Templates expand per node: {hostname} to the node's name, {local_rank} to 0 on both,
    {job} to torchrun's --rdzv-id; in the shared folder the directory names keep the two
    ranks apart."""
    dirs = {}
    for r in job.finished():
        host = _host_of(r)
        own = r.phases["offload"].offload["rank_dirs"]
        prefix = f"ssdtrain.{JOB}.{host}.rank{r.rank}.pid"
        assert [os.path.dirname(d) for d in own] == [
            os.path.join(job.root, "shared", JOB), os.path.join(job.root, host, "nvme0", JOB)], own
        assert all(os.path.basename(d).startswith(prefix) for d in own), own
        dirs[r.rank] = own
    assert not set(dirs[0]) & set(dirs[1])
    # Every file seen under the roots during the job (the dead processes' aside) is under the
    # directories of exactly one rank, and each rank has some.
    seen = set().union(*(r.phases["offload"].offload["files_seen"] for r in job.finished()))
    owners = {p: [rank for rank, own in dirs.items() if any(p.startswith(d + os.sep) for d in own)]
              for p in seen if not p.startswith(tuple(job.planted.values()))}
    assert all(len(o) == 1 for o in owners.values()), owners
    assert all(any(o == [rank] for o in owners.values()) for rank in dirs), owners


def test_each_rank_writes_its_own_stats_file(job):
    folder = os.path.join(job.workdir, "stats")
    expected = {f"{_host_of(r)}.rank{r.rank}.local0.{JOB}.jsonl": r for r in job.finished()}
    assert sorted(os.listdir(folder)) == sorted(expected)
    for name, r in expected.items():
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        steps = [row for row in rows if "run" not in row]  # the per-run header line
        assert len(steps) == len(r.phases["offload"].offload["steps"]) == LAYOUTS["tp2"].iterations
        assert sum(s["bytes_read"] for s in steps) > 0, steps


def test_clean_on_one_node_never_touches_the_other_nodes_job(job):
    out = job.clean_node1
    assert out.returncode == 0, out.stdout + out.stderr
    removed = set(job.before_clean) - set(job.after_clean)
    dead1 = os.path.relpath(job.planted["node1"], job.root)
    assert removed == {dead1, os.path.join(dead1, "owner.json"), os.path.join(dead1, "slab.0")}, \
        sorted(removed)
    assert {k: v for k, v in job.before_clean.items() if k not in removed} == job.after_clean
    lines = out.stdout.splitlines()
    live = {host: [os.path.join(job.root, p) for p in job.before_clean
                   if os.path.basename(p).startswith(f"ssdtrain.{JOB}.{host}.")] for host in NODES}
    assert all(len(live[host]) == len(OFFLOAD["dirs"]) for host in NODES), live
    for d in live["node0"]:  # one kernel: node0's lock is seen from node1
        assert [x for x in lines if x.startswith(f"live     {d} ") and "locked" in x], out.stdout
    assert [x for x in lines if x.startswith(f"skipped  {job.planted['node0']} ")
            and "written by another machine or an earlier boot" in x], out.stdout
    for d in live["node1"]:
        assert [x for x in lines if x.startswith(f"live     {d} ")], out.stdout
    assert [x for x in lines if x.startswith(f"removed  {job.planted['node1']} ")], out.stdout


def test_nothing_is_left_on_disk_after_the_job_and_node0s_own_clean(job):
    for r in job.finished():
        info = r.phases["offload"].offload
        assert all(s["bytes_on_disk"] == 0 for s in info["steps"]), r.rank
        assert info["files_after_close"] == []
    dead0 = os.path.relpath(job.planted["node0"], job.root)
    # The folders above each template's {job} component stay (a job removes its job folders
    # only); below them, after the job, only node0's dead directory is left ...
    roots = ["node0", os.path.join("node0", "nvme0"), "node1", os.path.join("node1", "nvme0"), "shared"]
    assert sorted(job.after_job) == sorted(roots + [os.path.join("shared", "deadjob"), dead0,
                                                    os.path.join(dead0, "owner.json"),
                                                    os.path.join(dead0, "slab.0")]), sorted(job.after_job)
    # ... which the clean on node0 removes, with its job folder (deadjob, named after its job
    # id) that this empties; "shared", above the {job} folder, was not the job's and stays.
    assert job.clean_node0.returncode == 0, job.clean_node0.stdout + job.clean_node0.stderr
    assert f"removed  {job.planted['node0']} " in job.clean_node0.stdout
    assert sorted(job.after_clean_node0) == sorted(roots), job.clean_node0.stdout
