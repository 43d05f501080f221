"""The adaptive policy's loop: measure a step, plan per layer, re-plan when things change.

The decision itself is the pure ``plan.policy.plan_layers``; this class only turns a step's
measurements (per-layer forward time and bytes, achieved bandwidth) into its inputs and its
output into per-layer decisions for the offloader.
"""

from __future__ import annotations

import logging
from typing import Dict, Hashable, List, Optional, Sequence

from ..config import OffloadConfig
from ..plan.policy import LayerMeasurement, LayerPlan, plan_layers, should_replan
from ..telemetry.stats import StepStats

log = logging.getLogger(__name__)


class AdaptivePlanner:
    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.plan: Optional[LayerPlan] = None
        self.plan_write_bps = 0.0
        self.replans = 0

    def update(self, stats: StepStats, order: Sequence[Hashable], layer_rows: Dict[str, object],
               num_micro_batches: int) -> Optional[Dict[Hashable, str]]:
        """New decisions per layer key, or None to keep the current plan."""
        write_bps, read_bps = stats.write_gbps * 1e9, stats.read_gbps * 1e9
        if not order or write_bps <= 0 or read_bps <= 0:
            return None  # nothing was measured (no layers, or nothing went through the drive)
        if self.plan is not None and not should_replan(
                stats.io_wait_s, max(stats.iteration_time_s or stats.step_time_s, 1e-9),
                self.config.replan_io_wait_fraction, self.plan_write_bps, write_bps):
            return None
        n = max(num_micro_batches, 1)
        layers: List[LayerMeasurement] = []
        for key in order:
            row = layer_rows.get(str(key))
            fwd = row.forward_s / n if row else 0.0
            nbytes = row.bytes // n if row else 0
            layers.append(LayerMeasurement(forward_s=fwd, activation_bytes=nbytes))
        self.plan = plan_layers(layers, write_bps=write_bps, read_bps=read_bps, num_micro_batches=n,
                                keep_last_layers=self.config.keep_last_layers,
                                recompute_fallback=self.config.recompute_fallback,
                                memory_budget_bytes=self.config.memory_budget_bytes)
        self.plan_write_bps = write_bps
        self.replans += 1
        keep_tail = self.config.keep_last_layers
        decisions = {}
        for i, (key, d) in enumerate(zip(order, self.plan.decisions)):
            # The last layers are the offloader's to keep (only when backward follows at once);
            # the planner keeps them by construction, which would also pin them in pipelines.
            decisions[key] = "offload" if i >= len(order) - keep_tail else d
        log.info("ssdtrain adaptive plan #%d (write %.2f GB/s, read %.2f GB/s): keep %s, offload %s, "
                 "recompute %s; predicted stall %.3fs", self.replans, write_bps / 1e9, read_bps / 1e9,
                 _names(order, decisions, "keep"), _names(order, decisions, "offload"),
                 _names(order, decisions, "recompute"), self.plan.io_stall_s)
        return decisions


def _names(order, decisions, what) -> str:
    keys = [str(k) for k in order if decisions[k] == what]
    return "[" + ", ".join(keys) + "]" if keys else "none"
