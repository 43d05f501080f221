"""Where a run's files live and the one archive that comes back (no torch: the parent's).

The GPU machines copy back a few files of the output folder (8 at most, 16 MiB each, two
folders down), so a run leaves exactly one file under ``--out``: ``<suite>-results.tar.gz``,
packed in the parent's ``finally`` whatever ended the run (its end, an error, SIGTERM, SIGINT,
SIGHUP). What it packs is the run's results folder, ``<out>/<suite>-results/`` while the run
goes (removed once packed): the suite's JSON, ``table.txt``, ``steps/``, ``logs/``,
``traces/``. The archive stays under :data:`ARCHIVE_MAX` bytes: the traces (largest first),
then the logs, are left out where the whole would not fit, and ``left-out.txt`` in the archive
names them.

What is no result lives outside ``--out``, under the run's scratch folder
``<scratch>/<suite>-scratch/`` (``--scratch``, default the checkout's disk): the bundle
installed (``prefix/``), torch's extensions, and the drive's files (``drive/``, the children's
``--scratch``, removed by each child at its end and by the parent at the run's end).
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tarfile
import zlib
from typing import Dict, List, Tuple

log = logging.getLogger(__name__)

MiB = 1 << 20
ARCHIVE_MAX = 15 * MiB
"""The archive's size at most: under the 16 MiB a returned file may have, with room to spare."""
MEMBER_OVERHEAD = 1024
"""A tar member's header and padding, in the estimate of what a file adds to the archive."""
LEFT_OUT = "left-out.txt"


def results_dir(out: str, suite: str) -> str:
    """The run's results folder while it runs: packed into :func:`archive_path`, then removed."""
    return os.path.join(out, f"{suite}-results")


def archive_path(out: str, suite: str) -> str:
    return os.path.join(out, f"{suite}-results.tar.gz")


def scratch_dir(scratch: str, suite: str) -> str:
    """The run's own folder under --scratch: the only one the run creates and removes there."""
    return os.path.join(scratch, f"{suite}-scratch")


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def scratch_problem(out: str, scratch: str) -> str:
    """Why --scratch cannot be used with --out (it would be packed, or remove the results), or ""."""
    if _inside(scratch, out):
        return (f"--scratch {scratch} is inside --out {out}: --out must hold only the archive that comes back; "
                f"give a directory outside it (default: the checkout's disk)")
    if _inside(out, scratch):
        return (f"--out {out} is inside --scratch {scratch}: scratch is removed at the end; give an --out "
                f"outside it")
    return ""


def _priority(rel: str) -> Tuple[int, str]:
    """Order of what is kept: the results at the top, the steps' own results, the logs, the traces."""
    top = rel.split(os.sep, 1)[0]
    return ({"steps": 1, "logs": 2, "traces": 3}.get(top, 0 if os.sep not in rel else 2), rel)


def _compressed(path: str) -> int:
    """What ``path`` adds to a gzip stream, about (zlib at the archive's level)."""
    z, n = zlib.compressobj(6), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MiB), b""):
            n += len(z.compress(chunk))
    return n + len(z.flush()) + MEMBER_OVERHEAD


def pack(folder: str, dest: str, max_bytes: int = ARCHIVE_MAX) -> Dict[str, object]:
    """``folder`` into the gzip'd tar ``dest`` (members under the folder's name), at most
    ``max_bytes``: what would not fit is left out, traces first (largest first), then logs,
    and named in ``left-out.txt`` in the archive. Returns {path, bytes, files, left_out}."""
    files: List[str] = []
    for root, _, names in os.walk(folder):
        files += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    files.sort(key=_priority)
    sizes = {f: _compressed(os.path.join(folder, f)) for f in files}
    droppable = sorted((f for f in files if _priority(f)[0] >= 2), key=lambda f: (-_priority(f)[0], -sizes[f]))
    left: List[str] = []
    base = os.path.basename(folder.rstrip(os.sep))
    tmp = dest + ".tmp"
    while True:
        while droppable and sum(sizes[f] for f in files if f not in left) + 4 * MEMBER_OVERHEAD > max_bytes:
            left.append(droppable.pop(0))
        with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
            for f in files:
                if f not in left:
                    tar.add(os.path.join(folder, f), arcname=os.path.join(base, f), recursive=False)
            if left:
                text = "".join(f"{f} ({os.path.getsize(os.path.join(folder, f))} bytes): over the archive's "
                               f"{max_bytes} bytes\n" for f in left).encode()
                info = tarfile.TarInfo(os.path.join(base, LEFT_OUT))
                info.size = len(text)
                tar.addfile(info, io.BytesIO(text))
        size = os.path.getsize(tmp)
        if size <= max_bytes or not droppable:
            break
        left.append(droppable.pop(0))  # the estimate was short: one more out, packed again
    os.replace(tmp, dest)
    if size > max_bytes:
        log.warning("%s is %d bytes, over %d, with every trace and log left out", dest, size, max_bytes)
    return {"path": dest, "bytes": size, "files": len(files) - len(left), "left_out": left}


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
