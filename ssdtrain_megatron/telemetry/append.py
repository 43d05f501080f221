"""The files a job appends its statistics and IO trace to, opened once and never through a link.

A stats or trace path may sit in a folder other users can write to (a shared ``out/``, ``/tmp``).
Opened by path at every step, a symlink or another file put there between two steps would
receive our lines (or, followed, let them land in any file we may write). So the file is opened
once, at the first line, with ``O_NOFOLLOW | O_APPEND | O_CREAT``, mode 0600 (whatever the
umask), and every later line goes to that descriptor. A fixed path that is a symlink when the
job starts is the user's choice (``layout.expand_file`` allows it where no placeholder names
it): it is resolved then, once, and its target opened the same way.
"""

from __future__ import annotations

import os
import stat
import weakref


class AppendFile:
    """One file appended to in whole lines; opened lazily (a run without steps leaves none)."""

    def __init__(self, path: str) -> None:
        self.path = path
        """The path the settings name (what messages show)."""
        self._target = os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)
        self._fd: int = -1
        self._finalizer: weakref.finalize = None  # closes the descriptor once this is dropped

    def _open(self) -> int:
        os.makedirs(os.path.dirname(self._target), exist_ok=True)
        try:
            fd = os.open(self._target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as exc:
            if os.path.islink(self._target):
                raise OSError(exc.errno, f"{self.path} became a symlink after the job started; "
                                         "refusing to follow it", self.path) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{self.path} is not a plain file; refusing to append to it")
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        return fd

    def write(self, text: str) -> None:
        """Append ``text`` (whole lines) with one write: O_APPEND puts it at the end."""
        fd = self._fd if self._fd >= 0 else self._open()
        data = text.encode("utf-8")
        while data:
            data = data[os.write(fd, data):]

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._fd = -1
