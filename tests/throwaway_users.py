"""A throwaway system user for tests that play another user on a shared drive (made with
useradd where the tests run as root, removed afterwards)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
from typing import Iterator, Optional


@contextlib.contextmanager
def throwaway_user(prefix: str) -> Iterator[Optional[int]]:
    """Its uid, or None where this process is not root or useradd is missing."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        yield None
        return
    name = f"{prefix}{os.getpid() % 100000}"
    subprocess.run(["useradd", "-M", "-r", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], capture_output=True)
