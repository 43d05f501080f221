"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd of Debian's
slurm-wlm (22.05), started in a private folder with a minimal slurm.conf for this host.

Everything lives under one short folder in /tmp (munge's socket path must stay short): the
key, the sockets, the state and spool folders, the logs. The daemons run in the foreground as
children of the test process and are stopped (SIGTERM, then SIGKILL) by :meth:`stop`. Plugins
that need cgroups or accounting are left out, so it runs in a container:
ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, no accounting.

:func:`unavailable` says why a cluster cannot be started here (binaries missing, not root),
for a skip message.

``SlurmCluster(nodes=["n1", "n2"])`` makes a cluster of several nodes on this one host: one
slurmd per node, each with its own port, spool folder and log, and each in a node of
``two_nodes`` (its own UTS and mount namespace: the node's hostname, its own boot id, an
/etc/hosts that resolves every node's name), so the jobs' processes on each node see that
node's name, as on a real cluster. Debian's slurm-wlm needs no multiple-slurmd build for this:
each slurmd is alone in its namespace with the name it runs as. The nodes share this host's
disk and cores (``cpus`` is split between them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import two_nodes

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo")


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}")
                                       if os.access(p, os.X_OK)), None)


def unavailable() -> Optional[str]:
    """Why a test cluster cannot run here, or None."""
    missing = [n for n in DAEMONS + CLIENTS if _which(n) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y "
                "slurm-wlm munge (as .ci/run does)")
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (slurmd runs jobs as their user)"
    return None


def _parent(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + slurmd on this host, one partition ``test`` with this node (or
    with ``nodes``, one slurmd each, see the module docstring)."""

    def __init__(self, cpus: int = 2, nodes: Optional[Sequence[str]] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="slurm-", dir="/tmp")
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.nodes = [two_nodes.Node(n, os.path.join(self.dir, "nodes"), list(nodes))
                      for n in nodes] if nodes else []
        self._procs: Dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    # -- life cycle -----------------------------------------------------------------------

    def start(self, timeout: float = 60) -> "SlurmCluster":
        d = self.dir
        for sub in ("state", "spool", "munge"):
            os.makedirs(os.path.join(d, sub), mode=0o700)
        key = os.path.join(d, "munge", "munge.key")
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
        os.chmod(key, 0o600)
        sock = os.path.join(d, "munge", "sock")
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--socket={sock}",
                               f"--key-file={key}", f"--log-file={d}/munged.log",
                               f"--pid-file={d}/munged.pid", f"--seed-file={d}/munge/seed"])
        self._wait_for(lambda: os.path.exists(sock), timeout, "munged did not create its socket")
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        with open(self.conf, "w") as fh:
            fh.write(f"""ClusterName=ssdtrain-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool{"-%n" if self.nodes else ""}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd{"-%n" if self.nodes else ""}.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd{"-%n" if self.nodes else ""}.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MinJobAge=600
SlurmdParameters=config_overrides
{self._node_lines(max(mem - 1024, 1024))}""")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", self.conf])
        if not self.nodes:
            self._spawn("slurmd", [_which("slurmd"), "-D", "-f", self.conf, "-N", self.host])
        for node in self.nodes:
            os.makedirs(os.path.join(d, f"spool-{node.name}"), mode=0o700)
            self._spawn(f"slurmd-{node.name}",
                        node.enter([_which("slurmd"), "-D", "-f", self.conf, "-N", node.name]))
        self._wait_for(self._node_idle, timeout, "the node did not come up idle")
        return self

    def _node_lines(self, mem_mb: int) -> str:
        """slurm.conf's NodeName and PartitionName lines."""
        if not self.nodes:
            return (f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem_mb} "
                    f"State=UNKNOWN\nPartitionName=test Nodes={self.host} Default=YES "
                    "MaxTime=INFINITE State=UP\n")
        cpus = max(self.cpus // len(self.nodes), 1)
        mem = max(mem_mb // len(self.nodes), 512)
        lines = [f"NodeName={n.name} NodeAddr=127.0.0.1 NodeHostname={n.name} Port={_free_port()} "
                 f"CPUs={cpus} RealMemory={mem} State=UNKNOWN" for n in self.nodes]
        names = ",".join(n.name for n in self.nodes)
        return "\n".join(lines) + f"\nPartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP\n"

    def job_processes(self) -> List[int]:
        """Processes started for this cluster's jobs (slurmstepd, the job's own), found by the
        SLURM_CONF in their environment; the daemons are not counted."""
        daemons = {p.pid for p in self._procs.values() if p.poll() is None}
        return [pid for pid in self._marked() if pid not in daemons and _parent(pid) not in daemons]

    def _marked(self) -> List[int]:
        """Every process with this cluster's SLURM_CONF in its environment (but this one)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if mark in fh.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
        return found

    @staticmethod
    def describe(pids: List[int]) -> List[str]:
        """``pid: command line`` of each process, for messages."""
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
                out.append(f"{pid}: {cmdline}")
            except OSError:
                out.append(f"{pid}: (gone)")
        return out

    def stop(self) -> List[str]:
        """Cancel every job, stop the daemons (slurmd first) and remove the folder. Returns the
        job processes that were still running afterwards (killed with SIGKILL)."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--partition=test", check=False)
            deadline = time.monotonic() + 60
            while self.job_processes() and time.monotonic() < deadline:
                time.sleep(0.2)
        slurmds = [n for n in self._procs if n.startswith("slurmd")]
        for name in slurmds + ["slurmctld", "munged"]:
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(20)
        time.sleep(0.5)  # helpers (slurmscriptd) leave with their daemon
        pids = self._marked()
        left = self.describe(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
        return left

    def _spawn(self, name: str, argv: List[str]) -> None:
        log = open(os.path.join(self.dir, f"{name}.out"), "w")
        try:
            self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                 env=self.env, start_new_session=True)
        finally:
            log.close()

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}: {self.log(name)[-3000:]}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} within {timeout:g}s: {self.logs()[-4000:]}")

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return out.returncode == 0 and out.stdout.split() == ["idle"] * max(len(self.nodes), 1)

    # -- clients ------------------------------------------------------------------------------

    def run(self, cmd: str, *args: str, check: bool = True, cwd: Optional[str] = None,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        out = subprocess.run([_which(cmd), *args], capture_output=True, text=True, timeout=60,
                             cwd=cwd, env=dict(self.env, **(env or {})))
        if check and out.returncode != 0:
            raise RuntimeError(f"{cmd} {' '.join(args)} exited {out.returncode}: {out.stderr}")
        return out

    def sbatch(self, *args: str, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> str:
        """Submit; returns the job id."""
        return self.run("sbatch", "--parsable", *args, cwd=cwd, env=env).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Reason, StdOut, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED",
                                                        "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> Dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} ({info.get('Reason')}) "
                                   f"after {timeout:g}s")
            time.sleep(0.5)

    def log(self, name: str) -> str:
        text = ""
        for path in (os.path.join(self.dir, f"{name}.log"), os.path.join(self.dir, f"{name}.out")):
            if os.path.exists(path):
                with open(path, errors="replace") as fh:
                    text += fh.read()
        return text

    def logs(self) -> str:
        names = ["munged", "slurmctld"] + ([f"slurmd-{n.name}" for n in self.nodes] or ["slurmd"])
        return "\n".join(f"== {n}\n{self.log(n)[-2000:]}" for n in names)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

