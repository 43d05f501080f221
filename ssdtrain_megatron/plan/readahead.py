"""How far ahead of backward to read: by time, not by a fixed count of layers.

A read issued when backward enters layer l+w for layer l has the backward compute of the w
layers between to arrive in; reads queue on one link (or drive). So it is in time when
w >= ceil(R / C), R the time the link takes for one layer's bytes and C one layer's backward
compute, and one more layer keeps the link busy while the next read is issued. When reads are
slower than compute (R > C) no window hides them, but a wider one starts them earlier and keeps
the link saturated; the caller bounds it by bytes (the read-ahead cap) and the activation
budget, which is what holds its memory. ``prefetch_layers`` is where a run starts, before it
measured anything, and the least it reads ahead after.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

BACKWARD_PER_FORWARD = 2.0
"""A layer's backward takes about twice its forward (two matmuls per forward one)."""


def readahead_layers(start: int, layer_bytes: float, read_bps: float, backward_s: float, most: int) -> int:
    """Layers to read ahead of backward: at least ``start`` (``prefetch_layers``), enough that
    each read arrives before backward reaches it (module docstring), at most ``most``. Without
    a measurement (a figure <= 0): ``start``."""
    if layer_bytes <= 0 or read_bps <= 0 or backward_s <= 0:
        return start
    need = math.ceil(layer_bytes / read_bps / backward_s) + 1
    return max(1, min(max(start, need), max(most, start)))


def measured_window(start: int, stats, num_micro_batches: int) -> Optional[int]:
    """The window from a finished step's StepStats: the bytes each offloaded layer of a
    micro-batch moved, the read bandwidth the step achieved, and a layer's backward as measured
    (LayerStats.backward_s, the timed layers'), else BACKWARD_PER_FORWARD times its forward.
    None: the step measured no read."""
    n = max(num_micro_batches, 1)
    moved: Sequence = [r for r in stats.layers if r.bytes_offloaded]
    if not moved or stats.read_gbps <= 0:
        return None
    layer_bytes = sum(r.bytes_offloaded for r in moved) / len(moved) / n
    timed = [r.backward_s for r in moved if r.backward_s > 0]
    backward_s = (sum(timed) / len(timed) if timed
                  else BACKWARD_PER_FORWARD * sum(r.forward_s for r in moved) / len(moved)) / n
    return readahead_layers(start, layer_bytes, stats.read_gbps * 1e9, backward_s, len(stats.layers))
