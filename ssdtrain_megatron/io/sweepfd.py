"""Sweeps by descriptor: the folders a sweep walks, held open, and whose they are.

Why: a sweep that judges a rank directory through one lookup of a folder's path and removes
it through a second lookup removes whatever the path names at the second moment. A folder of
another user swapped for a symlink between the two (an inotify watch tells its owner when the
sweep looks) steers the removal into the folder the link names: root's sweep then deleted a
running job of a third user. So a sweep holds the descriptor of every folder it walks, from
the one the user named (by path: its symlinks are the user's) down, each opened relative to
its parent without following links (``O_NOFOLLOW | O_DIRECTORY``); it judges and removes the
entries of a folder through that one descriptor (``clean.clean_dir``), and removes the empty
job folders above through the held descriptors too (:func:`prune`). Nothing is followed.

Whose folders: a sweep walks only folders owned by the user it removes for, or by root (who
does not attack). Run by a user, that is the user. Run by root, it is anyone in root's own
folders, and the owner of the first folder below them that belongs to somebody else
(``/raid/alice``): below it only alice's folders are walked and only alice's rank directories
removed (:func:`walks_for`). The walk is a loop with its depth bounded (``MAX_DEPTH``), so a
tree 1,100 folders deep costs a line, not a RecursionError; what it leaves out is tallied in a
:class:`Skips` and said in one line.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .dirfd import DIR_FLAGS, remove_entry_dir, user_name

MAX_DEPTH = 64
"""Folder levels below a ROOT that ``ssdtrain clean`` walks (the documented layouts use fewer
than ten); deeper folders are skipped and counted."""

FOREIGN = "foreign"
DEEP = "deep"
LINK = "link"
MANY = "many"
_TEXT = {
    FOREIGN: "folder{s} of another user than the one the sweep removes for, not walked",
    DEEP: f"folder{{s}} deeper than {MAX_DEPTH} levels, not walked",
    LINK: "symlink{s}, not followed",
    MANY: "rank director{ies} past the start-up sweep's bound, not judged (`ssdtrain clean` judges all)",
}


class Skips:
    """What a sweep left out, by reason, with the first path of each: for one line."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}
        self.first: Dict[str, str] = {}

    def add(self, reason: str, path: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, path)

    def line(self) -> Optional[str]:
        """``skipped 3 symlinks, not followed (first: /r/x); ...``, or None when nothing was."""
        if not self.counts:
            return None
        parts = []
        for reason, n in self.counts.items():
            text = _TEXT[reason].format(s="" if n == 1 else "s", ies="y" if n == 1 else "ies")
            parts.append(f"{n} {text} (first: {self.first[reason]})")
        return "skipped " + "; ".join(parts)


def walks_for(for_uid: Optional[int], st_uid: int) -> Tuple[bool, Optional[int]]:
    """Whether a sweep removing for ``for_uid`` (None: anyone, root in root's own folders)
    walks a folder owned by ``st_uid``, and for whom it removes below that folder."""
    if st_uid == 0:
        return True, for_uid
    if for_uid is None:
        return True, st_uid
    return st_uid == for_uid, for_uid


def sweeper() -> Optional[int]:
    """For whom a sweep run by this process removes at the start: itself, or (root) anyone."""
    uid = os.getuid()
    return None if uid == 0 else uid


def owner_text(st_uid: int, for_uid: int) -> str:
    """``owned by bob (uid 1001), not by alice`` for a folder or directory left alone."""
    who = "us" if for_uid == os.getuid() else user_name(for_uid)
    return f"owned by {user_name(st_uid)} (uid {st_uid}), not by {who}"


@dataclasses.dataclass
class Folder:
    """One folder of a walk, held open: ``name`` in the folder above (``""`` for the first)."""

    fd: int
    path: str
    name: str
    for_uid: Optional[int]
    depth: int = 0
    pending: Optional[List[str]] = None  # sub-folders still to walk (None: not listed yet)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_top(path: str, skips: Skips) -> Optional[Folder]:
    """The folder the user named (by path: its symlinks are the user's), or None when it is
    not the sweep's to walk (counted in ``skips``). Raises OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    ok, for_uid = walks_for(sweeper(), os.fstat(fd).st_uid)
    if not ok:
        os.close(fd)
        skips.add(FOREIGN, path)
        return None
    return Folder(fd, path, "", for_uid)


def open_below(parent: Folder, name: str, skips: Skips) -> Optional[Folder]:
    """``name`` in ``parent``, opened without following a link, if it is a folder the sweep
    walks; None (counted in ``skips`` unless it is gone or not a folder). Raises OSError when
    it cannot be opened (unreadable)."""
    path = os.path.join(parent.path, name)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent.fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if exc.errno == errno.ELOOP or _is_link(parent.fd, name):
            skips.add(LINK, path)
        return None
    ok, for_uid = walks_for(parent.for_uid, os.fstat(fd).st_uid)
    if not ok:
        os.close(fd)
        skips.add(FOREIGN, path)
        return None
    return Folder(fd, path, name, for_uid, parent.depth + 1)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def walk(top: Folder, is_rank_name: Callable[[str], bool], skips: Skips,
         unreadable: Callable[[str, OSError], None], max_depth: int = MAX_DEPTH) -> Iterator[List[Folder]]:
    """Every folder below ``top`` (and ``top``) that holds rank directory names, depth first,
    as the held chain of folders from ``top`` down to it; rank directories are not entered.
    The caller cleans the last folder of the chain through its descriptor before asking for
    the next (it may remove the empty ones with :func:`prune`). Closes every descriptor,
    ``top``'s included. An unreadable folder below ``top`` goes to ``unreadable``; ``top``'s
    listing raises OSError."""
    stack = [top]
    try:
        while stack:
            here = stack[-1]
            if here.pending is None:
                try:
                    with os.scandir(here.fd) as it:
                        entries = [(e.name, e.is_dir(follow_symlinks=False), e.is_symlink()) for e in it]
                except OSError as exc:
                    if here is top:
                        raise
                    unreadable(here.path, exc)
                    entries = []
                entries.sort()
                here.pending = []
                ranks = False
                for name, is_dir, is_link in entries:
                    if is_rank_name(name):
                        ranks = True
                    elif is_link:
                        skips.add(LINK, os.path.join(here.path, name))
                    elif is_dir:
                        here.pending.append(name)
                here.pending.reverse()
                if ranks:
                    yield stack
            if not here.pending:
                stack.pop().close()
                continue
            name = here.pending.pop()
            if here.depth >= max_depth:
                skips.add(DEEP, os.path.join(here.path, name))
                continue
            try:
                below = open_below(here, name, skips)
            except OSError as exc:
                unreadable(os.path.join(here.path, name), exc)
                continue
            if below is not None:
                stack.append(below)
    finally:
        for folder in stack:
            folder.close()


def open_path(base: str, path: str, skips: Skips) -> Optional[List[Folder]]:
    """The chain of folders from ``base`` (by path: the fixed part of a template, the user's)
    down to ``path`` below it, each opened without following a link and walked by the owner
    rule; None (counted in ``skips``) when one of them is not the sweep's to walk or is gone.
    The caller closes the chain (:func:`close_all`). Raises OSError when one cannot be opened."""
    top = open_top(base, skips)
    if top is None:
        return None
    chain = [top]
    try:
        rest = os.path.relpath(path, base)
        for name in ([] if rest == "." else rest.split("/")):
            below = open_below(chain[-1], name, skips)
            if below is None:
                close_all(chain)
                return None
            chain.append(below)
    except BaseException:
        close_all(chain)
        raise
    return chain


def close_all(chain: List[Folder]) -> None:
    for folder in chain:
        folder.close()


def prune(chain: List[Folder], levels: int, owner: Optional[int]) -> List[str]:
    """Remove the last folder of ``chain`` and those above it, ``levels`` in all, while each
    is empty, still the folder held, not a mount point, not the chain's first, and owned by
    ``owner`` (None: anyone's, for root); stop at the first that is not. Returns the paths
    removed; their descriptors stay open until the walk closes them."""
    removed: List[str] = []
    for i in range(len(chain) - 1, max(0, len(chain) - 1 - levels), -1):
        folder, parent = chain[i], chain[i - 1]
        try:
            uid = os.fstat(folder.fd).st_uid
        except OSError:
            break
        if owner is not None and uid != owner:
            break
        if not remove_entry_dir(parent.fd, folder.name, folder.fd):
            break
        folder.pending = []
        removed.append(folder.path)
    return removed
