"""A file of ours that we append to in a folder other users may write to (the stats and trace
files: ``stats_path``, ``trace_path``).

Why: a shared ``out/`` (a group's 2775 folder, a 1777 ``/tmp``) lets anyone put something
where our file goes: a symlink to a file of root's or of ours (followed, our lines land there),
a FIFO (an open for writing blocks until someone reads: the first step hangs), or a file of
their own, 0666 (our lines go to them). So the folders are reached the way a rank directory is
(``dirfd.open_chain``: from the part of the template the user wrote, one component at a time,
never through a link, the missing ones made 0700 whatever the umask), and the file is opened
relative to its folder's descriptor with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO refuses at once
instead of blocking) ``| O_APPEND | O_CREAT | O_CLOEXEC``, mode 0600, then judged by ``fstat`` on
that descriptor: a regular file of our user's, with one link, that no group or other may write.
Anything else is refused in one line naming the path, what is there, its owner and the fix.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Optional

from .dirfd import LayoutError, entry_facts, open_chain, owner_and_mode

APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FILE_MODE = 0o600


def file_problem(st: os.stat_result, uid: Optional[int] = None) -> Optional[str]:
    """Why a file with this ``stat`` must not get our lines (None when it may); the text
    follows "... is" and ends with the fix."""
    uid = os.geteuid() if uid is None else uid
    facts = owner_and_mode(st)
    if stat.S_ISLNK(st.st_mode):
        return (f"a symlink ({facts}); refusing to follow it. Remove it, or name the file itself "
                "in the path")
    if stat.S_ISDIR(st.st_mode):
        return (f"a directory ({facts}); this setting names a file (one per rank with {{rank}}), "
                "which later runs append to")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a plain file"
        return (f"{kind} ({facts}); refusing to write to it. Remove it if someone put it there, or "
                "name another path")
    if st.st_uid != uid:
        return (f"another user's file ({facts}); refusing to hand it our lines. Remove it if someone "
                "put it there, or name another path (a folder of your own, or {user} in the path)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"writable by its group or others ({facts}); refusing to append to it. chmod go-w it, "
                "or name another path")
    if st.st_nlink != 1:
        return (f"a file with {st.st_nlink} hard links ({facts}); our lines would land in the other "
                "names too. Remove it, or name another path")
    return None


def open_append(path: str, base: Optional[str] = None, what: str = "") -> int:
    """The descriptor of ``path`` opened for appending, as the module docstring says: its
    folders walked from ``base`` (the directory above the first placeholder of the template;
    by default, or when it does not exist, the deepest existing directory above ``path``),
    the missing ones made 0700.

    Raises:
        LayoutError: one line naming the path (``what``: the setting it comes from), what is
            there, its owner and the fix."""
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    chain = open_chain(folder, create=True, base=base if base and os.path.isdir(base) else None,
                       what=what, check_base=False)
    try:
        try:
            fd = os.open(name, APPEND_FLAGS, FILE_MODE, dir_fd=chain.fd)
        except OSError as exc:
            raise LayoutError(_refusal(path, what, exc, chain.fd, name)) from None
        try:
            problem = file_problem(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        if problem:
            os.close(fd)
            raise LayoutError(f"{path!r}{what} is {problem}")
        return fd
    finally:
        chain.close()


def _refusal(path: str, what: str, exc: OSError, dir_fd: int, name: str) -> str:
    """One line for an entry the open itself refused (a link: ELOOP; a FIFO nobody reads:
    ENXIO; a directory: EISDIR; another user's file or FIFO: EACCES)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return f"{path!r}{what} cannot be opened for appending ({exc.strerror or exc}; {entry_facts(dir_fd, name)})"
    problem = file_problem(st)
    if problem and exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM,
                                 errno.ENOTDIR):
        return f"{path!r}{what} is {problem}"
    return f"{path!r}{what} cannot be opened for appending ({exc.strerror or exc}; {owner_and_mode(st)})"
