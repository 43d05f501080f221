"""Each tier's traffic in a step, from the engine's per-tier meters (StepStats.tier_*).

An engine reports its tiers through ``IOEngine.tier_meters()``: one engine, one tier, whose
meters are the engine's own; the tiered engine, its host tier's and its SSD tier's. The
offloader has already taken the engine's own meters for the step (write_gbps, read_gbps): a
tier whose meter is one of those gets that figure, not a second (empty) take.
"""

from __future__ import annotations

from typing import Dict, Tuple

Traffic = Tuple[int, float]
"""(bytes, busy seconds), as BusyMeter.take() returns them."""


def tier_traffic(engine, write: Traffic, read: Traffic) -> Dict[str, Tuple[Traffic, Traffic]]:
    """Per tier of ``engine``: its (write, read) traffic since the last step, given the
    engine's own ``write`` and ``read`` already taken."""
    out: Dict[str, Tuple[Traffic, Traffic]] = {}
    for tier, (write_meter, read_meter) in engine.tier_meters().items():
        w = write if write_meter is engine.write_meter else write_meter.take()
        r = read if read_meter is engine.read_meter else read_meter.take()
        out[tier] = (w, r)
    return out
