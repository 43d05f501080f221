"""Nodes on one machine, for tests of multi-node jobs: each node a UTS and mount namespace.

A node has its own hostname (``hostname`` in a UTS namespace), its own boot id (a file bound
over /proc/sys/kernel/random/boot_id in its mount namespace: two real nodes never share one,
and ``io/owner.py`` reads it to tell a dead job from a live one) and an /etc/hosts that
resolves every node's name to the loopback address, as a cluster's name service would. The
pid namespace, the network and the disk are the machine's: the nodes share one filesystem,
as ranks on several nodes share a parallel filesystem. Needs root (``unshare --mount``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from typing import Dict, List, Optional, Sequence

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def namespaces_refused() -> Optional[str]:
    """Why nodes cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root: a node is a mount namespace (unshare --mount) with its own hostname"
    missing = [t for t in ("unshare", "nsenter", "mount", "hostname") if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux, hostname)"
    with tempfile.NamedTemporaryFile("w", suffix=".boot_id") as fake:
        fake.write("probe\n")
        fake.flush()
        script = f"hostname ssdtrain-probe && mount --bind {fake.name} {BOOT_ID} && hostname && cat {BOOT_ID}"
        try:
            done = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c", script],
                                  capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return "unshare --uts --mount did not finish in 60 s"
    if done.returncode != 0 or done.stdout.split() != ["ssdtrain-probe", "probe"]:
        return (f"unshare --uts --mount with hostname and a bind mount is refused here "
                f"(exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return None


class Node:
    """One node: its name, boot id and, once started, the process holding its namespaces."""

    def __init__(self, name: str, folder: str, all_names: Sequence[str]) -> None:
        self.name = name
        os.makedirs(folder, exist_ok=True)
        self.boot_id_file = os.path.join(folder, f"{name}.boot_id")
        with open(self.boot_id_file, "w") as fh:
            fh.write(f"{uuid.uuid4()}\n")
        self.hosts_file = os.path.join(folder, "hosts")
        with open(self.hosts_file, "w") as fh:
            fh.write("127.0.0.1 localhost " + " ".join(all_names) + "\n")
        self.proc: Optional[subprocess.Popen] = None

    def enter(self, argv: Sequence[str]) -> List[str]:
        """``argv`` inside this node: a fresh namespace set up as the node's."""
        script = (f"mount --bind {self.hosts_file} /etc/hosts && "
                  f"mount --bind {self.boot_id_file} {BOOT_ID} && hostname {self.name} && exec \"$@\"")
        return ["unshare", "--uts", "--mount", "sh", "-c", script, self.name, *argv]

    def start(self, argv: Sequence[str], env: Dict[str, str], log_path: str, cwd: str) -> None:
        """Start the node's main process (a torchrun agent); it holds the namespaces."""
        with open(log_path, "w") as log:
            # A session of its own: a kill reaches the agent's group; its workers, in sessions
            # of their own (torchrun starts them so), are found through kill_tree.
            self.proc = subprocess.Popen(self.enter(argv), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)

    def run(self, argv: Sequence[str], env: Dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
        """Run ``argv`` on this node: in its live namespaces (nsenter) while its main process
        runs, else in fresh ones set up the same way (same hostname and boot id)."""
        if self.proc is not None and self.proc.poll() is None:
            cmd = ["nsenter", "--target", str(self.proc.pid), "--uts", "--mount", *argv]
        else:
            cmd = self.enter(argv)
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)

    def stop(self) -> None:
        """Kill the node's main process and everything it started (no-op when done)."""
        if self.proc is not None:
            kill_tree(self.proc.pid)
            self.proc.wait()


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and all its descendants (found through /proc, whatever their session)."""
    children: Dict[int, List[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    todo, tree = [root], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
