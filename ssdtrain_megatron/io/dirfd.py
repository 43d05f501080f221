"""Directories by descriptor: the chain from an offload root down to a rank directory.

Why: a path is looked up again at every use, so whoever may change a directory on it can put
a symlink or a folder of their own in place of one of ours between our check and our use, and
the job then creates, lists and deletes files where they chose (for a job run as root: any
file on the node). So the chain is walked once, one component at a time (``openat`` with
``O_NOFOLLOW | O_DIRECTORY``, ``mkdirat`` for a missing one, made 0700 by ``fchmod`` whatever
the umask, a setgid parent or a default ACL gave it), each directory is checked on the
descriptor we go on to use, and the rank directory's descriptor is held for the job's life:
every later create, unlink, list and remove is made relative to it (``dir_fd``).

A directory is trusted when nobody but us and root can rename or replace what is in it: owned
by us or by root, and writable by its group or by others only with the sticky bit (which lets
others add entries but not rename or remove ours). A root-owned ``/tmp``-style root (1777)
passes; a 1777 root another user owns does not (the owner of a sticky directory may rename
anything in it), nor a group-writable project root (2775) without the sticky bit.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from typing import List, Optional

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_MODE = 0o700


class LayoutError(RuntimeError):
    """A root or directory cannot be used safely; the message says which and why."""


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def trust_problem(st: os.stat_result, uid: Optional[int] = None) -> Optional[str]:
    """Why a directory with this ``stat`` is not safe to create our folders in (None when it
    is): someone else than us and root could rename or replace our entries there. The text,
    to follow "... is", names its owner and mode and ends with the fix."""
    uid = os.getuid() if uid is None else uid
    if st.st_uid not in (uid, 0):
        return (f"owned by {user_name(st.st_uid)} (uid {st.st_uid}), not by us or root (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): its owner can rename or replace what we put in it; "
                "refusing to write under it. Use a directory of your own (mkdir -m 700), or remove it "
                f"if someone put it there; {PER_USER_FIX}")
    sticky = st.st_mode & stat.S_ISVTX
    if st.st_mode & stat.S_IWOTH and not sticky:
        return (f"world-writable without the sticky bit ({owner_and_mode(st)}): anyone can rename or "
                "replace what we put in it; chmod 700 it, or set the sticky bit (chmod +t) on a shared root")
    if st.st_mode & stat.S_IWGRP and not sticky:
        return (f"group-writable without the sticky bit ({owner_and_mode(st)}): any member can rename "
                "or replace what we put in it; chmod g-w it, set the sticky bit (chmod +t), or use a "
                "directory of your own")
    return None


PER_USER_FIX = ("where several users share a root, give each a folder of their own above {job} "
                "({user} in the template: /raid/{user}/ssdtrain/{job}), or point --ssd-offload-dir "
                "(or the stats or trace path) elsewhere")
"""The fix for a folder another user made or holds where ours should go (docs/cluster.md)."""


def owner_and_mode(st: os.stat_result) -> str:
    """``owner alice (uid 1001), mode 0700``: what a refusal says of a folder or file."""
    return f"owner {user_name(st.st_uid)} (uid {st.st_uid}), mode {stat.S_IMODE(st.st_mode):04o}"


def entry_facts(dir_fd: int, name: str) -> str:
    """:func:`owner_and_mode` of the entry ``name`` below ``dir_fd`` (not followed), or why it
    cannot be looked at."""
    try:
        return owner_and_mode(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except OSError as exc:
        return f"cannot be looked at: {exc.strerror or exc}"


def refused_text(path: str, exc: OSError, facts: str) -> str:
    """One line for a folder the kernel does not let us open or make a folder in: the path,
    the error, its owner and mode (``facts``), and, where we lack the rights (EACCES, EPERM),
    the fix."""
    if exc.errno not in (errno.EACCES, errno.EPERM):
        return f"{path} cannot be used ({exc.strerror or exc}; {facts})"
    return (f"{path} cannot be used ({exc.strerror or exc}; {facts}): another user's folder, or one "
            f"we may not enter; {PER_USER_FIX}")


def vanished_text(path: str, exc: OSError) -> str:
    """One line for a directory that went away or turned read-only under a running job."""
    if exc.errno == errno.EROFS:
        return (f"offload directory {path} is on a read-only filesystem now (remounted read-only, "
                "most often after a drive error; see dmesg)")
    if exc.errno in (errno.ENOENT, errno.ESTALE, errno.ENOTDIR):
        return (f"offload directory {path} is gone ({exc.strerror}): it was removed while the job ran "
                "(an `rm`, a /tmp cleaner, a job sweeping with another user's rights) or its drive was "
                "unmounted")
    return f"offload directory {path} cannot be used: {exc.strerror or exc}"


class DirChain:
    """Held descriptors of a directory chain: ``fds[0]`` the base (opened by path: the part of
    a template the user wrote, where symlinks are theirs), ``fds[i]`` the component
    ``names[i]`` below ``fds[i - 1]``. ``made`` is how many at the end this walk created."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.fds: List[int] = []
        self.names: List[str] = []
        self.made = 0

    @property
    def path(self) -> str:
        return os.path.join(self.base, *self.names[1:]) if self.names else self.base

    @property
    def fd(self) -> int:
        return self.fds[-1]

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def undo(self) -> None:
        """Remove the directories this walk created (empty ones only), then close."""
        for i in range(len(self.fds) - 1, len(self.fds) - 1 - self.made, -1):
            if i <= 0 or not remove_entry_dir(self.fds[i - 1], self.names[i], self.fds[i]):
                break
        self.made = 0
        self.close()

    def _what(self, name: str, what: str) -> str:
        return f"{os.path.join(self.path, name)!r}{what}"

    def step(self, name: str, create: bool, what: str = "", fresh: bool = False) -> bool:
        """Open (``create``: make first) the directory ``name`` below the chain's end and check
        it; False when it does not exist and ``create`` is off. ``fresh``: it must be new.

        Raises LayoutError: a symlink, not a directory, untrusted, or (``fresh``) already there."""
        if name in ("", ".", "..") or "/" in name:
            raise LayoutError(f"{name!r} below {self.path!r} is not one plain folder name")
        made = False
        if create:
            try:
                os.mkdir(name, DIR_MODE, dir_fd=self.fd)
                made = True
            except FileExistsError:
                if fresh:
                    kind = "a symlink" if _is_link(self.fd, name) else "in use"
                    raise LayoutError(f"{self._what(name, what)} already exists ({kind}): another offloader "
                                      "of this process uses the same root, or something was put there; run "
                                      f"`ssdtrain clean {self.path}`") from None
            except (FileNotFoundError, NotADirectoryError):
                raise
            except OSError as exc:  # EACCES, EPERM, EROFS, ...: we may not make a folder here
                raise LayoutError(refused_text(self._what(name, what), exc,
                                               f"in {self.path}: {entry_facts(self.fd, '.')}")) from None
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            if create:
                raise
            return False
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise LayoutError(refused_text(self._what(name, what), exc, entry_facts(self.fd, name))) from None
            if _is_link(self.fd, name):
                raise LayoutError(f"{self._what(name, what)} is a symlink where a job directory should be; "
                                  f"refusing to follow it ({entry_facts(self.fd, name)}). Remove it, or put "
                                  "the link's target in dirs") from None
            raise LayoutError(f"{self._what(name, what)} is not a directory ({entry_facts(self.fd, name)})") from None
        self.fds.append(fd)
        self.names.append(name)
        if made:
            self.made += 1
            os.fchmod(fd, DIR_MODE)  # the umask, a setgid parent or a default ACL may have widened it
        st = os.fstat(fd)
        problem = trust_problem(st) if not made else (
            None if st.st_uid == os.getuid() else f"was replaced right after we made it ({owner_and_mode(st)})")
        if problem:
            raise LayoutError(f"{self.path!r}{what} is {problem}")
        return True


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def remove_entry_dir(parent_fd: int, name: str, fd: int) -> bool:
    """rmdir ``name`` below ``parent_fd`` when it still is the directory ``fd`` holds (not
    something put in its place), empty, and not a mount point. True when removed."""
    try:
        held, entry, parent = os.fstat(fd), os.stat(name, dir_fd=parent_fd, follow_symlinks=False), os.fstat(parent_fd)
        if (entry.st_dev, entry.st_ino) != (held.st_dev, held.st_ino) or held.st_dev != parent.st_dev:
            return False
        os.rmdir(name, dir_fd=parent_fd)
    except OSError:  # not empty, gone, or not ours to remove
        return False
    return True


def open_base(base: str) -> int:
    """The descriptor of ``base``, opened by path (the part of a template the user wrote).

    Raises LayoutError (its owner and mode, and the fix) where we may not open it."""
    try:
        return os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as exc:
        try:
            facts = owner_and_mode(os.stat(base))
        except OSError as again:
            facts = f"cannot be looked at: {again.strerror or again}"
        raise LayoutError(refused_text(repr(base), exc, facts)) from None


def open_chain(path: str, create: bool, base: Optional[str] = None, what: str = "",
               check_base: bool = True) -> DirChain:
    """Walk from ``base`` (a directory above ``path``, opened by path; by default the
    deepest one of ``path`` that exists) down to ``path`` one component at a time, creating
    the missing ones when ``create``. The base is checked too unless ``check_base`` is off.
    Without ``create`` the walk stops at the first missing component (``chain.path`` says
    where). Raises LayoutError (one line naming the directory and the fix); a created
    directory is removed again when a later step fails."""
    path = os.path.abspath(path)
    if base is not None and os.path.relpath(path, os.path.abspath(base)).split("/")[0] == "..":
        base = None  # not above path: walk from path's own deepest existing directory
    if base is None:
        base = path
        while not os.path.isdir(base) and base != "/":
            base = os.path.dirname(base)
    base = os.path.abspath(base)
    chain = DirChain(base)
    chain.fds.append(open_base(base))
    chain.names.append(base)
    try:
        problem = trust_problem(os.fstat(chain.fd)) if check_base else None
        if problem:
            raise LayoutError(f"offload root {base!r} is {problem}")
        rest = os.path.relpath(path, base)
        for name in ([] if rest == "." else rest.split("/")):
            if not chain.step(name, create, what):
                break
    except BaseException:
        chain.undo()
        raise
    return chain
