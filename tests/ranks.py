"""One process per rank, for the multi-rank tests (the megatron and DeepSpeed harnesses).

The parent writes the spec to ``workdir/spec.json`` and starts ``world_size`` processes, each
running ``<module>._worker_main()`` with ``spec.json`` and ``workdir`` as arguments and the
usual torch.distributed variables set; each rank writes ``result<rank>.pt`` and its output
goes to ``rank<rank>.log``. The first rank to fail, or the deadline, stops them all, and the
error carries the end of that rank's log.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, spec_json: str, world_size: int, timeout_s: float, workdir: str,
              extra_env: Optional[Dict[str, str]] = None) -> List[Any]:
    """Run ``module``'s worker on every rank; the results, ordered by rank."""
    os.makedirs(workdir, exist_ok=True)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
        f.write(spec_json)
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore", **(extra_env or {}))
        env["PYTHONPATH"] = os.pathsep.join(
            [REPO, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        log = open(os.path.join(workdir, f"rank{rank}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", f"import {module} as h; h._worker_main()", spec_path, workdir],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    deadline = time.monotonic() + timeout_s
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            if failed is None:
                for rank, p in enumerate(procs):
                    if p.poll() not in (None, 0):
                        failed = rank
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for rank, p in enumerate(procs):
            if p.poll() not in (None, 0) and failed is None:
                failed = rank
    finally:
        timed_out = any(p.poll() is None for p in procs)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    if failed is not None or timed_out:
        which = failed if failed is not None else 0
        with open(os.path.join(workdir, f"rank{which}.log")) as f:
            tail = f.read()[-6000:]
        reason = "timed out" if failed is None else f"rank {which} exited {procs[which].returncode}"
        raise RuntimeError(f"{module} run {reason}; log of rank {which}:\n{tail}")
    return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False)
            for r in range(world_size)]
