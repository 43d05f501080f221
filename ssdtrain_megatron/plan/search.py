"""The layouts offload makes possible: every (tp, pp, cp, micro-batch, recompute) of a model on
a number of GPUs and a global batch, planned on a node without offload (keep and per-layer
recompute, as Megatron does alone) and with it (host memory and the drives too), ranked by
modeled tokens/s per GPU. Pure: the analytic model of plan/stage.py and plan/tiers.py.

What stays fixed: the model, the GPU count (tp x pp x cp x dp), the global batch in sequences
(dp x micro-batch x micro-batches), expert parallelism (it must divide dp x cp), dtype and the
FP8 and the overlap flags (the job's own). What varies: tp (up to the node's GPUs, with sequence
parallelism when tp > 1; tp x cp within one node's NVLink), pp (a divisor of the layers, up to
16), the virtual pipeline (with pp > 1: 1, the job's own, and each divisor of a stage's layers
up to 8), cp (1, 2, 4, 8 at every sequence length, with fused attention), the micro-batch, the
recompute granularity, and the distributed optimizer (the job's, and on where the job has it
off). A layout fits when the model state and the reserve (plan/fit.py) leave room for
activations and the plan fits what is left. The ranking with offload holds only plans that
offload something: a plan that keeps everything is no gain of offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

from .fit import DEFAULT_RESERVE_BYTES
from .memory import model_state_bytes
from .node import NodeProfile
from .shape import ModelShape, SaveProfile
from .stage import Stage, plan_stage, stage
from .tiers import HOST, KEEP, PLACES, RECOMPUTE, SSD, TierPlan

WITHOUT_OFFLOAD = (KEEP, RECOMPUTE)
WITH_OFFLOAD = PLACES
MAX_PP = 16
MAX_MICRO_BATCH = 16
MAX_VP = 8


@dataclass(frozen=True)
class Layout:
    """One layout, planned."""

    shape: ModelShape
    num_micro_batches: int
    plan: TierPlan
    stage: Stage
    budget_bytes: int
    tokens_per_s_per_gpu: float

    @property
    def offloads(self) -> bool:
        return self.plan.tier_bytes[HOST] + self.plan.tier_bytes[SSD] > 0

    def key(self) -> Tuple[int, ...]:
        return layout_key(self.shape)


def layout_key(s: ModelShape) -> Tuple[int, ...]:
    """Ties between layouts as fast: the smaller layout first."""
    return (s.tp, s.pp, s.cp, s.micro_batch, ("none", "selective", "full").index(s.recompute),
            s.vp, int(not s.distributed_optimizer))


def _divisors(n: int, limit: int) -> List[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def layouts(base: ModelShape, gpus: int, global_batch: int,
            node: NodeProfile) -> Iterator[Tuple[ModelShape, int]]:
    """(shape, micro-batches) of every layout to try; see the module docstring."""
    cps = [c for c in (1, 2, 4, 8) if base.seq_len % c == 0] if base.flash_attention else [1]
    optimizers = (True, False) if not base.distributed_optimizer else (True,)
    for tp in _divisors(node.gpus_per_node, node.gpus_per_node):
        for cp in cps:
            if tp * cp > node.gpus_per_node:
                continue
            for pp in _divisors(base.num_layers, MAX_PP):
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if (dp * cp) % base.ep:
                    continue
                for b in _divisors(global_batch // dp if global_batch % dp == 0 else 0,
                                   MAX_MICRO_BATCH):
                    for vp, recompute, dist in _variants(base, pp, optimizers):
                        try:
                            shape = base.replace(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch=b,
                                                 sequence_parallel=tp > 1, recompute=recompute,
                                                 vp=vp, distributed_optimizer=dist)
                        except ValueError:
                            continue  # heads, groups or ffn not divisible by tp, and the like
                        yield shape, global_batch // (dp * b)


def _variants(base: ModelShape, pp: int, optimizers: Tuple[bool, ...]):
    """(vp, recompute, distributed optimizer) to try for a pipeline of ``pp`` stages."""
    per_stage = base.num_layers // pp
    vps = [1] if pp == 1 else sorted({1, base.vp if per_stage % base.vp == 0 else 1}
                                     | {v for v in _divisors(per_stage, MAX_VP)})
    for vp in vps:
        for recompute in ("none", "selective", "full"):
            for dist in optimizers:
                yield vp, recompute, dist


def plan_layout(shape: ModelShape, m: int, node: NodeProfile, places: Tuple[str, ...],
                profile: SaveProfile, global_batch: int, gpus: int,
                keep_last_layers: int = 1,
                reserve: int = DEFAULT_RESERVE_BYTES) -> Optional[Layout]:
    """The layout planned with ``places``, or None when it does not fit the GPU: the model
    state and the ``reserve`` (plan/fit.py) come off its memory before activations."""
    budget = node.gpu_memory_bytes - model_state_bytes(shape)["bytes"] - reserve
    if budget <= 0:
        return None
    st = stage(shape, profile, node, m)
    plan = plan_stage(st, node, budget_bytes=budget, places=places,
                      keep_last_layers=keep_last_layers)
    if not plan.fits_budget:
        return None
    tokens = global_batch * shape.seq_len / plan.iteration_s / gpus
    return Layout(shape, m, plan, st, budget, tokens)


def search(base: ModelShape, gpus: int, global_batch: int, node: NodeProfile,
           profile: SaveProfile = SaveProfile.paper(),
           keep_last_layers: int = 1,
           reserve: int = DEFAULT_RESERVE_BYTES) -> Tuple[List[Layout], List[Layout]]:
    """(without offload, with offload): the layouts that fit, fastest first; ``reserve``: GPU
    memory no layout may use (plan/fit.py)."""
    without: List[Layout] = []
    with_: List[Layout] = []
    for shape, m in layouts(base, gpus, global_batch, node):
        for places, out in ((WITHOUT_OFFLOAD, without), (WITH_OFFLOAD, with_)):
            found = plan_layout(shape, m, node, places, profile, global_batch, gpus,
                                keep_last_layers, reserve)
            if found is not None and (places == WITHOUT_OFFLOAD or found.offloads):
                out.append(found)
    order = (lambda x: (-x.tokens_per_s_per_gpu, x.key()))
    return sorted(without, key=order), sorted(with_, key=order)
