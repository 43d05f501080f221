"""Planning: the analytic model (activation bytes per layer, FLOPs, required bandwidth, SSD
lifespan) and the adaptive keep / offload / recompute decision. Pure Python: nothing here
imports torch or megatron."""

from .lifespan import Lifespan, endurance_bytes, ssd_lifespan
from .model import (DTYPE_BYTES, ModelShape, SaveProfile, estimate_step_time_s,
                    forward_flops_per_layer, head_activation_terms, largest_micro_batch,
                    layer_activation_bytes, layer_activation_terms, peak_activation_bytes,
                    required_write_gbps, training_flops_per_micro_batch)
from .policy import (KEEP, OFFLOAD, RECOMPUTE, LayerMeasurement, LayerPlan, plan_layers,
                     should_replan, simulate_micro_batch)

__all__ = [
    "DTYPE_BYTES", "KEEP", "OFFLOAD", "RECOMPUTE", "LayerMeasurement", "LayerPlan", "Lifespan",
    "ModelShape", "SaveProfile", "endurance_bytes", "estimate_step_time_s",
    "forward_flops_per_layer", "head_activation_terms", "largest_micro_batch",
    "layer_activation_bytes", "layer_activation_terms", "peak_activation_bytes", "plan_layers",
    "required_write_gbps", "should_replan", "simulate_micro_batch", "ssd_lifespan",
    "training_flops_per_micro_batch",
]
