"""`ssdtrain bench --background-load N`: N busy processes competing for the CPU.

A user's machine is rarely quiet: another job, a data loader, a noisy neighbour. The bench runs
the same comparison under contention by starting N processes that spin on the CPU for as long
as every strategy's steps run, and stopping them after, whatever happens in between (an error,
Ctrl-C). Each one also watches its parent and exits when the parent is gone, so that not even a
SIGKILL of the bench leaves one behind.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import os
from typing import List

log = logging.getLogger(__name__)

# Spin; every few milliseconds check that the bench that started us is still our parent.
_SPIN = ("import os, sys\n"
         "parent = int(sys.argv[1])\n"
         "while os.getppid() == parent:\n"
         "    for _ in range(100000):\n"
         "        pass\n")


class BackgroundLoad:
    """``with BackgroundLoad(n):`` n busy processes run inside the block, none after it.

    Example:
        >>> with BackgroundLoad(1) as load:
        ...     len(load.pids)
        1
    """

    def __init__(self, processes: int) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ValueError(f"processes={processes!r} is invalid: expected an integer >= 0")
        self.processes = processes
        self._procs: List[subprocess.Popen] = []

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> "BackgroundLoad":
        try:
            for _ in range(self.processes):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(os.getpid())], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        if self._procs:
            log.info("ssdtrain bench: %d background load process(es) started: %s", len(self._procs),
                     ", ".join(map(str, self.pids)))
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after a second) and reap it."""
        procs, self._procs = self._procs, []
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
