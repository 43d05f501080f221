"""Users for tests that play several people on one node: a throwaway group with a victim and an
attacker in it (made with groupadd/useradd where the tests run as root, removed afterwards),
commands run as one of them, and a function run in a forked child as one of them with a
deadline (a call that would block for ever, an open of a FIFO, comes back as "hung")."""

from __future__ import annotations

import codecs
import contextlib
import grp
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, Optional, Tuple

import pytest


@contextlib.contextmanager
def two_users(prefix: str) -> Iterator[Optional[SimpleNamespace]]:
    """``victim`` and ``attacker`` (each: name, uid, gid) in one throwaway group (``gid``,
    ``group``); None where this process is not root or useradd is missing."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        yield None
        return
    tag = f"{os.getpid() % 100000}"
    group = f"{prefix}g{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    made = []
    try:
        users = {}
        for role in ("victim", "attacker"):
            name = f"{prefix}{role[0]}{tag}"
            subprocess.run(["useradd", "-M", "-N", "-g", group, "-s", "/bin/sh", name], check=True,
                           capture_output=True)
            made.append(name)
            users[role] = SimpleNamespace(name=name, uid=pwd.getpwnam(name).pw_uid, gid=grp.getgrnam(group).gr_gid)
        yield SimpleNamespace(group=group, gid=grp.getgrnam(group).gr_gid, **users)
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def users_fixture(prefix: str):
    """A module-scoped fixture: :func:`two_users`, or the test skipped with the reason."""
    @pytest.fixture(scope="module")
    def users():
        with two_users(prefix) as found:
            if found is None:
                pytest.skip("needs root and useradd to play two users of one node (the tests make "
                            "throwaway users)")
            yield found
    return users


def scratch_fixture(prefix: str, mode: int):
    """A fixture: a root's folder under /tmp, ``mode``, that the throwaway users can reach
    (pytest's tmp_path is 0700); removed afterwards."""
    @pytest.fixture
    def scratch():
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        os.chmod(path, mode)
        yield Path(path)
        shutil.rmtree(path, ignore_errors=True)
    return scratch


def sh_as(user, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) as ``user``; asserts it succeeded (the attack is the test's setup)."""
    done = subprocess.run(["sh", "-c", script], user=user.uid, group=user.gid, extra_groups=[user.gid],
                          capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, (script, done.stderr)
    return done


def call_as(user, fn: Callable[[], object], deadline_s: float = 60.0) -> Tuple[str, str]:
    """``fn()`` in a forked child running as ``user`` (None: as this process's user):
    ``("ok", str(result))``, ``(exception class name, message)``, or ``("hung", "")`` when
    no answer came within ``deadline_s`` (the child is killed then). The child imports
    nothing new (the interpreter's own library may be out of the user's reach): what ``fn``
    needs is loaded here first, before the fork, the codecs files are opened with included."""
    for codec in ("ascii", "utf-8", "latin-1"):
        codecs.lookup(codec)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, run, answer through the pipe
        try:
            os.close(read)
            if user is not None:
                os.setgroups([user.gid])
                os.setgid(user.gid)
                os.setuid(user.uid)
            try:
                answer = ("ok", str(fn()))
            except BaseException as exc:  # the test judges it
                answer = (type(exc).__name__, str(exc))
            os.write(write, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        if not select.select([read], [], [], deadline_s)[0]:
            os.kill(pid, signal.SIGKILL)
            return ("hung", "")
        chunks = []
        while True:
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        return tuple(json.loads(b"".join(chunks) or b'["no answer", ""]'))
    finally:
        os.close(read)
        os.waitpid(pid, 0)
