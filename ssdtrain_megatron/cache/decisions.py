"""What the plan can say for a layer (of a micro-batch): the offloader's decisions.

Four places an activation can spend the time between its forward and its backward: the GPU
('keep'), host memory ('host'), a drive ('ssd'), or nowhere ('recompute': the layer runs again
in backward from its input). 'offload' is the engine's default place, as before the tiers were
planned: with the tiered engine, host memory while it has room and SSD beyond; with any other
engine, its one place. 'host' and 'ssd' name the tier; an engine with one place ignores it.
"""

from __future__ import annotations

from ..io.base import TIERS

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"
HOST, SSD = TIERS

DECISIONS = (OFFLOAD, KEEP, RECOMPUTE) + TIERS
"""Every decision the offloader accepts (``set_layer_decision``, the adaptive plan)."""

OFFLOADS = (OFFLOAD,) + TIERS
"""The decisions that hand a tensor to the IO engine."""
