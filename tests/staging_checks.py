"""The staging-reuse check: every reader and writer of pinned pool bytes, ordered by CUDA's rules.

Used by every scene that runs the GPU data path on the recording stand-in
(tests/recording_streams.py): test_device_copy, test_staging_race, test_staged_writes,
test_memory_tier_direct, test_gpu_check_steps, test_restore_memory, test_restore_owner,
test_gpu_ordering.
"""

from __future__ import annotations

from typing import List

from tests.recording_streams import Recorder, _range, overlaps

READS_INTO = ("engine_read", "submit_read")  # a read from the engine into these bytes
WRITES_FROM = ("engine_write", "submit_write")  # a write to the engine out of these bytes


def staging_accesses(rec: Recorder, lo_hi: tuple) -> List[tuple]:
    """Every access to pool bytes in log order: (node, byte range, writes?). Copies into
    (writes) and out of (reads) them on any stream; a read from the engine into them, at its
    submission and at each chunk the IO thread brings from the file (``disk_read`` of its
    key: writes); a write to the engine out of them, at each chunk the IO thread takes to the
    file (``disk_write``: reads; the submission itself reads nothing: the IO thread waits for
    the copy's event first)."""
    out, where = [], {}  # key -> the bytes of its latest submission
    for n in rec.log:
        if n.kind == "copy":
            for r, writes in ((n.tags["dst"], True), (n.tags["src"], False)):
                if overlaps(r, lo_hi):
                    out.append((n, r, writes))
        elif n.kind in READS_INTO + WRITES_FROM and overlaps(n.tags["ptr"], lo_hi):
            where[n.tags["key"]] = n.tags["ptr"]
            if n.kind in READS_INTO:
                out.append((n, n.tags["ptr"], True))
        elif n.kind in ("disk_read", "disk_write") and n.tags.get("key") in where:
            out.append((n, where[n.tags["key"]], n.kind == "disk_read"))
    return out


def check_staging_reuse(rec: Recorder, pool) -> int:
    """Every access to pool memory (a tensor, or its (first, past-last) byte range) that writes
    it is ordered after every earlier access to the same bytes, and every access that reads it
    after every earlier write (``staging_accesses``), by the CUDA programming model's rules
    alone. Returns how many such pairs it checked across different agents (a reuse of a
    block by another stream or another thread). Chunks of one engine transfer (one key) are
    not ordered among themselves, nor need to be."""
    lo_hi = pool if isinstance(pool, tuple) else _range(pool)
    earlier: List[tuple] = []
    pairs = 0
    for n, r, writes in staging_accesses(rec, lo_hi):
        for c, cr, cwrites in earlier:
            if not (writes or cwrites) or c.agent == n.agent or not overlaps(cr, r):
                continue
            if c.kind.startswith("disk_") and n.kind.startswith("disk_") and c.tags["key"] == n.tags["key"]:
                continue
            pairs += 1
            assert rec.happens_before(c, n), f"staging reuse (seed {rec.seed}): {c} is not ordered before {n}"
        earlier.append((n, r, writes))
    return pairs
