"""How ``ssdtrain io-bench`` sets an engine against the drive's limit: ABBA segments.

A virtual or shared drive changes speed within seconds: other tenants, bursts after a pause
(on this project's VM, 256 MiB baseline segments of one round ranged 0.53-1.66 GB/s). One long
baseline on each side of an engine cannot cancel that. So in each round the engine and the
baseline take turns in short segments, in the order baseline, engine, engine, baseline
(ABBA), repeated: a linear drift then costs both sides the same, each side follows itself and
the other side equally often, and a burst lands on segments of both sides. Each side's bytes
and seconds are summed over the round (bytes / seconds: a slow segment weighs by its time, as
a slow step does in training), and the round's ratio is the engine's GB/s over the baseline's.

Both sides write into fresh space, preallocated: the baseline a new file per segment, the
engine a new slab per step, since the offloader removes the slab at the end of every step
(io/slab_engine.py ``end_step``). A drive may write blocks it already holds faster than fresh
ones (this VM, ext4 mounted with ``discard``: 1.1 GB/s over 0.68, measured side by side), so
measuring the engine on reused blocks would show it faster than training runs it. The engine
is measured from its second step on (engine_side.py): what a job runs in after its first
step. And both sides move the bytes through the same memory (measure.py ``BenchMemory``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from .engine_side import EngineSide
from .measure import BaselineSide, Progress, Segment

ORDER = ("baseline", "engine", "engine", "baseline")
"""One quad of segments; a round repeats it."""


def segment_sizes(n_tensors: int, tensor_bytes: int, segment_bytes: int) -> List[int]:
    """Tensors per engine segment for one side's ``n_tensors`` a round: an even number of
    segments (two per quad), at least two, of about ``segment_bytes`` each (whole tensors, at
    least one; they differ by one tensor at most) adding up to ``n_tensors``."""
    wanted = max(1, round(n_tensors * tensor_bytes / max(segment_bytes, 1)))
    count = max(2, min(n_tensors, wanted + wanted % 2))
    count -= count % 2
    base, extra = divmod(n_tensors, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


@dataclass
class Round:
    """One round of one engine: each side's segments in the order measured, and their sums."""

    segments: List[Tuple[str, Segment]] = field(default_factory=list)

    def total(self, side: str) -> Segment:
        out = Segment()
        for s, got in self.segments:
            if s == side:
                out = out + got
        return out

    def ratio(self, op: str) -> float:
        """The engine's GB/s over the baseline's, each summed over the round."""
        return self.total("engine").gbps(op) / max(self.total("baseline").gbps(op), 1e-12)


def measure_round(baseline: BaselineSide, engine: EngineSide, directory: str, sizes: List[int],
                  progress: Progress) -> Round:
    """Segments of ``sizes`` tensors (an even number of them) in ABBA quads; each baseline
    segment moves as many bytes as the engine segment it pairs with."""
    out = Round()
    for q in range(0, len(sizes), 2):
        pair = {"baseline": [sizes[q], sizes[q + 1]], "engine": [sizes[q], sizes[q + 1]]}
        for side in ORDER:
            n = pair[side].pop(0)
            got = (baseline.segment(directory, n * engine.tensor_bytes) if side == "baseline"
                   else engine.step(n))
            out.segments.append((side, got))
            progress.tick(f"{engine.label} ABBA", len(out.segments), 2 * len(sizes))
    return out
