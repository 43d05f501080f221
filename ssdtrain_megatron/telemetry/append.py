"""The files a job appends its statistics and IO trace to, opened once and never through a link.

A stats or trace path may sit in a folder other users can write to (a shared ``out/``, ``/tmp``).
Opened by path at every step, a symlink or another file put there between two steps would
receive our lines (or, followed, let them land in any file we may write). So the file is opened
once, at the first line, through its folder's descriptor (``io/private_file.py``: the folders
from the template's fixed part down walked without following links and made 0700, the file
opened ``O_NOFOLLOW | O_NONBLOCK | O_APPEND | O_CREAT``, mode 0600, and judged by ``fstat``:
a regular file of ours that nobody else may write), and every later line goes to that
descriptor. A symlink is never followed, not even at a fixed path: name its target instead.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional

from ..io.private_file import open_append


class AppendFile:
    """One file appended to in whole lines; opened lazily (a run without steps leaves none).

    Args:
        path: the file (a template already expanded: ``layout.expand_file``).
        base: the directory the walk to its folder starts from, opened by path: the part of
            the template above its first placeholder (``layout.file_base``). By default the
            deepest existing directory above ``path``.
        flag: the setting the path comes from, named in a refusal."""

    def __init__(self, path: str, base: Optional[str] = None, flag: Optional[str] = None) -> None:
        self.path = path
        """The path the settings name (what messages show)."""
        self._target = os.path.abspath(path)
        self._base = base
        self._what = f" ({flag})" if flag else ""
        self._fd: int = -1
        self._finalizer: weakref.finalize = None  # closes the descriptor once this is dropped

    def _open(self) -> int:
        fd = open_append(self._target, self._base, self._what)
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        return fd

    def write(self, text: str) -> None:
        """Append ``text`` (whole lines) with one write: O_APPEND puts it at the end.

        Raises:
            LayoutError: the file or a folder above it is not ours to write (one line, the
                path, its owner and the fix)."""
        fd = self._fd if self._fd >= 0 else self._open()
        data = text.encode("utf-8")
        while data:
            data = data[os.write(fd, data):]

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._fd = -1
