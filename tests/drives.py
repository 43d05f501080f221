"""The offload roots a test uses, made to exist as mounting the drives would.

An offloader refuses a root that does not exist (io/roots.py): on a real node the root is a
mounted NVMe drive, created by the admin, never by us. A test that stands for such a node
creates its roots first with :func:`mount`; a test of the refusal itself does not.
"""

from __future__ import annotations

import os
from typing import List, Union

PathLike = Union[str, "os.PathLike[str]"]


def mount(*templates: PathLike) -> List[str]:
    """Create the root of each path template (the part above its first ``{job}`` component;
    the whole path without one) and return the templates as strings, for ``dirs``."""
    out = []
    for t in templates:
        t = os.fspath(t)
        parts = t.split("/")
        job = next((i for i, p in enumerate(parts) if "{job}" in p), len(parts))
        root = "/".join(parts[:job]) or "/"
        assert "{" not in root, f"{t}: a placeholder above {{job}}; create that root in the test"
        os.makedirs(root, exist_ok=True)
        out.append(t)
    return out
