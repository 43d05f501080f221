"""Where the start-up sweep and ``ssdtrain clean`` look: the existing directories a ``dirs``
template names on this host, for any job, rank and local rank (``clean.clean_templates``
then reaches each of them again through held descriptors, ``sweepfd.open_path``)."""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
import socket
import string
from typing import List, Optional

log = logging.getLogger(__name__)

MAX_SWEEP_ENTRIES = 4096
"""Entries the start-up sweep lists at most per directory where a template has a placeholder."""


def template_roots(template: str, hostname: Optional[str] = None) -> List[str]:
    """The existing directories a ``dirs`` template names on this host, for any job, rank and
    local rank: each placeholder but ``{hostname}`` (this host) matches any name."""
    hostname = hostname or socket.gethostname()
    parts = []
    for component in os.path.abspath(os.path.expanduser(template)).split("/")[1:]:
        pattern = ""
        for literal, field, _spec, _conv in string.Formatter().parse(component):
            pattern += glob.escape(literal)
            if field is not None:
                pattern += glob.escape(hostname) if field == "hostname" else "*"
        parts.append(pattern)
    return sorted(p for p in glob.glob("/" + "/".join(parts)) if os.path.isdir(p) and not os.path.islink(p))


def bounded_template_roots(template: str, hostname: Optional[str] = None,
                           max_entries: int = MAX_SWEEP_ENTRIES) -> List[str]:
    """:func:`template_roots` for the start-up sweep, bounded so that a big shared filesystem
    does not slow a job's start: a literal component is looked up, never listed; a component
    with a placeholder lists its parent, at most ``max_entries`` entries of it, and follows
    only directories (no symlinks) that belong to the user running the sweep (root: any), so
    it never descends into other users' trees. ``ssdtrain clean`` looks everywhere."""
    hostname = hostname or socket.gethostname()
    uid = os.getuid()
    paths = ["/"]
    for component in os.path.abspath(os.path.expanduser(template)).split("/")[1:]:
        pieces = list(string.Formatter().parse(component))
        if all(field is None for _lit, field, _s, _c in pieces):
            paths = [os.path.join(p, component) for p in paths
                     if os.path.isdir(os.path.join(p, component))]
            continue
        pattern = "".join(glob.escape(lit) + ("" if field is None else glob.escape(hostname)
                                             if field == "hostname" else "*")
                          for lit, field, _s, _c in pieces)
        nxt = []
        for parent in paths:
            nxt.extend(_matching_dirs(parent, pattern, uid, max_entries))
        paths = nxt
    return sorted(p for p in paths if not os.path.islink(p))


def _matching_dirs(parent: str, pattern: str, uid: int, max_entries: int) -> List[str]:
    out = []
    try:
        with os.scandir(parent) as it:
            for n, entry in enumerate(it):
                if n >= max_entries:
                    log.warning("ssdtrain: the start-up sweep for leftovers stopped after %d entries of "
                                "%s; `ssdtrain clean --dirs ...` looks at all of them", max_entries, parent)
                    break
                if not fnmatch.fnmatchcase(entry.name, pattern) or not entry.is_dir(follow_symlinks=False):
                    continue
                if uid == 0 or entry.stat(follow_symlinks=False).st_uid == uid:
                    out.append(entry.path)
    except OSError:
        pass  # unreadable: nothing of ours can be swept there anyway
    return out
