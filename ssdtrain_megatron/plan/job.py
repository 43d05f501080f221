"""From a job to the settings it runs: the one sequence behind ``ssdtrain plan``, the
pre-flight and ``install()`` (DESIGN.md, "From a job to its settings").

A job is described once, at the door, as a :class:`Job`: the OffloadConfig its preset and
flags give (and which fields they set), its model per GPU as it will run (the preset's model
with Megatron's arguments over it: layout, data-parallel size from the world size, micro-batch,
sequence, recompute), the node, the host memory per rank it may fill, and the micro-batches per
iteration. :func:`job_settings` turns it into :class:`Settings`: engine, policy, recompute
fallback, budget, host pool, pinned staging, read-ahead start and the place of every layer.
The doors are megatron/follow_node.py (the launcher's parsed arguments at install, and the
command line for the pre-flight) and tools/plan/cli.py (``ssdtrain plan``'s flags, or the
launcher's arguments after ``--``); none of them decides a setting itself.

The rules, in order:

0. megatron-core's optimizer CPU offload (``--optimizer-cpu-offload``) takes its host memory
   (plan/memory.py ``host_bytes``) out of the host memory per rank before anything of ours; a
   node whose host memory per rank cannot hold it and the pinned staging is refused.
1. Pinned staging (``pinned_staging_bytes``, else twice ``max_inflight_bytes``) comes out of
   the host memory per rank first (staging larger than it is refused where staging is pinned,
   ``Job.staging_pinned``: every local rank on a CUDA device pins its own; a job on a device
   without CUDA pins none); what is left is what a host pool may take.
2. The engine: as named (preset or flag), else the node's (plan/engine_choice.py): tiered with
   its policy and fallback where host memory holds one layer's activations, else posix.
3. The plan of the first pipeline stage for that engine, policy and fallback, with host
   memory of that size (a named pool's, where the engine's pool is named). The adaptive policy
   without a budget (neither ``activation_budget_bytes`` nor ``memory_budget_bytes``) keeps
   every layer at run time (cache/adaptive.py): it is planned as keep where that fits what the
   model state leaves; where it does not, the runtime gets that as its budget and the plan
   places each layer within it. A note says which. Layers named by ``recompute_layers`` are
   recompute in the places (refused without the recompute fallback, which alone runs them).
4. The host pool of an engine that has one (tiered, memory), unless given: what the plan puts
   in host memory and one layer more, within what is left.

Pure: numbers and OffloadConfigs in, Settings out; nothing here parses a command line or reads
/proc. Issue 58's "fit first" builds on :func:`job_settings` (the same Job, another choice).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from .engine_choice import (EngineChoice, HostNeed, choose_engine, forced, size,
                            tiered_settings)
from .fit import reserve_bytes
from .memory import activation_budget, model_state_bytes
from .node import NodeProfile
from .placing import places_for, plan_policy
from .shape import ModelShape, SaveProfile
from .stage import Stage, stage
from .tiers import TierPlan

log = logging.getLogger(__name__)

HOST_ENGINES = ("tiered", "memory")
"""Engines with a pinned host pool of ``host_memory_bytes``."""


class JobError(ValueError):
    """A combination that cannot run: one line naming the flag and what would fit."""


@dataclass(frozen=True)
class Job:
    """What a job is, parsed at the door (megatron/follow_node.py, tools/plan/cli.py)."""

    offload: Any
    """The OffloadConfig the preset and the flags give (defaults < preset < flags)."""
    given: Mapping[str, str]
    """{OffloadConfig field: who set it (``the preset``, a flag)}: these stay as they are."""
    shape: Optional[ModelShape]
    """The model per GPU as the job runs it (its dp from the world size); None: no model."""
    node: NodeProfile
    """The node: compute, GPU memory, link and drives (its host memory is ``host_bytes``)."""
    host_bytes: Optional[int]
    """Host memory per rank for offload, staging included; None where it cannot be known."""
    host_text: str = ""
    """Where ``host_bytes`` comes from, for the engine's line."""
    num_micro_batches: Optional[int] = None
    """Per iteration; None: not known (planned with the pipeline's depth, and said)."""
    recompute: bool = True
    """Whether the integration can recompute a layer (Megatron-DeepSpeed cannot)."""
    profile: SaveProfile = field(default_factory=SaveProfile.paper)
    memory_reserve: Optional[float] = None
    """GPU memory no plan uses (CUDA context, NCCL, fragmentation): bytes, or a fraction of the
    GPU's; None: plan/fit.py's default. It comes off the activation budget where none is set."""
    staging_pinned: bool = True
    """Whether the job pins its staging: True on a CUDA device and for a plan of a node
    profile (every profile is a GPU node); False at install on a device without CUDA, where
    the offloader allocates no staging (cache/offloader.py), so staging larger than the host
    memory per rank is not refused there (the demo, CPU training on a machine with little
    free memory). The accounting is the same either way (rule 1), so plan and install agree."""


@dataclass(frozen=True)
class Settings:
    """What a job runs: the OffloadConfig ``install()`` takes, and the plan behind it."""

    config: Any
    """The OffloadConfig to install (engine, policy, fallback and pool decided)."""
    choice: EngineChoice
    num_micro_batches: int
    budget_bytes: Optional[int]
    """The activation budget the runtime holds (None: none, as the runtime has none)."""
    plan_budget_bytes: int
    """What the plan checks its peak against: the budget, else GPU memory less the model state."""
    planned_policy: str
    """The policy planned (keep for adaptive without a budget)."""
    shape: Optional[ModelShape] = None
    """The model per GPU planned (the Job's)."""
    plan: Optional[TierPlan] = None
    stage: Optional[Stage] = None
    notes: Tuple[str, ...] = ()

    @property
    def host_pool_bytes(self) -> int:
        """The pinned host pool the engine allocates (0 for one without)."""
        c = self.config
        return c.host_memory_bytes if c.engine in HOST_ENGINES else 0

    @property
    def places(self) -> Tuple[str, ...]:
        """The place of each layer of the first stage for its first micro-batch."""
        return tuple(self.plan.decisions[0]) if self.plan is not None else ()

    def summary(self) -> Dict[str, Any]:
        """The settings as plan, pre-flight and the launcher print them (equal for one job)."""
        c = self.config
        return {"engine": c.engine, "policy": c.policy,
                "recompute_fallback": c.recompute_fallback,
                "activation_budget_bytes": self.budget_bytes,
                "memory_budget_bytes": c.memory_budget_bytes,
                "host_pool_bytes": self.host_pool_bytes, "staging_bytes": c.staging_bytes(),
                "prefetch_layers": c.prefetch_layers, "keep_last_layers": c.keep_last_layers,
                "num_micro_batches": self.num_micro_batches, "places": list(self.places)}

    def line(self) -> str:
        """The same fields in one line (the launcher's start-up line)."""
        s = self.summary()
        budget = "none" if s["activation_budget_bytes"] is None else size(s["activation_budget_bytes"])
        places = ",".join(p[0] for p in s["places"]) or "-"
        return (f"engine {s['engine']}, policy {s['policy']}, recompute fallback "
                f"{'on' if s['recompute_fallback'] else 'off'}, budget {budget}, host pool "
                f"{size(s['host_pool_bytes'])}, staging {size(s['staging_bytes'])}, read-ahead "
                f"from {s['prefetch_layers']} layer(s), {s['num_micro_batches']} micro-batch(es), "
                f"places {places}")


def _plan(job: Job, config: Any, host: int, m: int) -> Tuple[Stage, TierPlan, str, int, tuple]:
    """The plan of the first stage for ``config`` with ``host`` bytes of host memory per rank:
    (stage, plan, policy planned, the plan's budget, notes).

    The budget is ``activation_budget_bytes`` where the runtime holds one (adaptive, offload),
    else what the model state and the reserve leave of GPU memory: policy keep applies no budget
    (config.py), so a keep plan is measured against the GPU, not against a preset's fraction.
    The adaptive policy without a budget keeps every layer where that fits; where it does not,
    it is planned within what the model state leaves, the budget :func:`job_settings` then
    gives the runtime (so policy adaptive is returned with no budget in ``config``)."""
    if config.engine in HOST_ENGINES and "host_memory_bytes" in job.given:
        host = min(host, config.host_memory_bytes)  # a named pool bounds the host places
    shape, node = job.shape, job.node.replace(host_memory_bytes=max(host, 0))
    st = stage(shape, job.profile, node, m)
    held = None if config.policy == "keep" else config.activation_budget_bytes
    budget = activation_budget(shape, node.gpu_memory_bytes, None, held,
                               reserve=reserve_bytes(job.memory_reserve, node.gpu_memory_bytes)
                               )["activation_budget_bytes"]
    policy, notes = config.policy, ()
    if policy == "adaptive" and not has_budget(config):
        peak = st.layer_bytes * len(st.layers) * st.positions[0].live + st.head_bytes
        if peak <= budget:
            policy = "keep"
            notes = ("policy adaptive without a budget keeps every layer (cache/adaptive.py): "
                     f"{size(peak)} of activations fit the {size(budget)} the model state "
                     "leaves",)
        else:
            notes = (f"policy adaptive without a budget would keep every layer, but "
                     f"{size(peak)} of activations do not fit the {size(budget)} the model state "
                     "leaves: the runtime's budget is that (activation_budget_bytes), within "
                     "which the plan places each layer",)
    engine = config.engine
    plan = plan_policy(st, node, policy, places_for(engine, config.recompute_fallback), budget,
                       config)
    return st, plan, policy, budget, notes


def has_budget(config: Any) -> bool:
    """Whether the runtime has an activation budget (cache/adaptive.py ``has_budget``)."""
    return config.activation_budget_bytes is not None or config.memory_budget_bytes is not None


def _check_host(job: Job, config: Any, per_rank: int) -> Tuple[str, ...]:
    """A named host engine whose pool, or whose pool after pinned staging, is larger than the
    host memory there is: refused (JobError); so is pinned staging larger than it for any
    engine, where the job pins staging (``Job.staging_pinned``: not on a device without CUDA)."""
    staging = config.staging_bytes()
    if "pinned_staging_bytes" in job.given:
        who = f"pinned_staging_bytes, set by {job.given['pinned_staging_bytes']}"
    elif "max_inflight_bytes" in job.given:
        who = f"twice max_inflight_bytes, set by {job.given['max_inflight_bytes']}"
    else:
        who = "twice max_inflight_bytes"
    named_host = config.engine in HOST_ENGINES and "engine" in job.given
    if job.host_bytes is None or staging <= job.host_bytes or not job.staging_pinned:
        pass  # nothing pins staging without CUDA (Job.staging_pinned)
    elif named_host:
        raise JobError(f"pinned staging of {size(staging)} ({who}) leaves no host pool in the "
                       f"{size(job.host_bytes)} of host memory per rank ({job.host_text}): at "
                       f"most {size(job.host_bytes)} of staging fits, less the pool")
    else:  # every local rank pins its staging at start, whatever the engine (issue 66)
        raise JobError(f"pinned staging of {size(staging)} per rank ({who}) is more than the "
                       f"{size(job.host_bytes)} of host memory per rank ({job.host_text}): set "
                       f"--ssd-offload-pinned-staging-bytes to at most {size(job.host_bytes)}")
    if named_host and "host_memory_bytes" in job.given and config.host_memory_bytes > per_rank:
        raise JobError(f"{job.given['host_memory_bytes']}: a host pool of "
                       f"{size(config.host_memory_bytes)} is more than the {size(per_rank)} of "
                       f"host memory per rank left after {size(staging)} of pinned staging "
                       f"({job.host_text}): at most {size(per_rank)} fits")
    return ()


def _check_recompute_layers(job: Job, config: Any) -> None:
    """Layers named to recompute run so only with the recompute fallback (cache/decisions.py),
    and only where the integration can recompute: otherwise refused, never dropped."""
    if not config.recompute_layers:
        return
    flag = job.given.get("recompute_layers", "recompute_layers")
    layers = ",".join(str(n) for n in config.recompute_layers)
    if not job.recompute:
        raise JobError(f"{flag} {layers}: Megatron-DeepSpeed cannot recompute a layer; drop "
                       f"{flag}")
    if not config.recompute_fallback:
        raise JobError(f"{flag} {layers}: layers run recomputed only with the recompute "
                       "fallback, which is off here: add --ssd-offload-recompute-fallback, or "
                       f"drop {flag}")


def job_settings(job: Job) -> Settings:
    """The settings ``job`` runs (see the module docstring): the one function that decides.

    Raises:
        JobError: a pool or staging larger than the host memory there is, or layers named to
            recompute without the recompute fallback (one line).
    """
    job = less_optimizer_host(job)
    config, given = job.offload, job.given
    m = job.num_micro_batches or (job.shape.pp if job.shape is not None else 1)
    notes: Tuple[str, ...] = ()
    if job.num_micro_batches is None and job.shape is not None:
        notes = (f"micro-batches per iteration not given: planned with {m} (the pipeline's "
                 "depth); give --global-batch-size",)
    per_rank = None if job.host_bytes is None else max(0, job.host_bytes - config.staging_bytes())
    if per_rank is not None:
        notes += _check_host(job, config, per_rank)
    planned = None  # (config it was made for, stage, plan, policy, budget, notes)
    if "engine" in given:
        choice = forced(config.engine, f"{given['engine']} ({config.engine})")
    elif per_rank is None:
        choice = EngineChoice("posix", "engine posix: host memory cannot be measured here "
                                       "(no /proc/meminfo); --ssd-offload-engine tiered uses it")
    else:
        need = None
        if job.shape is not None:
            trial = config.replace(engine="tiered", **{
                k: v for k, v in tiered_settings(given, config, job.recompute).items()
                if k not in given})
            planned = (trial,) + _plan(job, trial, per_rank, m)
            need = HostNeed(planned[2].host_peak_bytes, planned[1].layer_bytes)
        choice = choose_engine(given, config, per_rank, job.host_text, need, job.recompute)
    config = config.replace(**choice.changes)
    _check_recompute_layers(job, config)
    if job.shape is None:
        return Settings(config, choice, m, _budget(config, None, job.node), 0, config.policy,
                        notes=notes)
    if planned is None or planned[0].engine != config.engine or planned[0].policy != config.policy \
            or planned[0].recompute_fallback != config.recompute_fallback:
        planned = (config,) + _plan(job, config, per_rank or 0, m)
    _, st, plan, policy, budget, more = planned
    if policy == "adaptive" and not has_budget(config):  # keep does not fit: hold the plan's
        config = config.replace(activation_budget_bytes=budget)
    if config.engine in HOST_ENGINES and "host_memory_bytes" not in given and per_rank is not None:
        config = config.replace(host_memory_bytes=min(per_rank, plan.host_peak_bytes + st.layer_bytes))
    return Settings(config, choice, m, _budget(config, job.shape, job.node), budget, policy,
                    job.shape, plan, st, notes + more)


def less_optimizer_host(job: Job) -> Job:
    """Rule 0: the job with the host memory megatron-core's optimizer CPU offload takes per rank
    subtracted (the job unchanged without it, or where host memory is not known).

    Raises:
        JobError: it and the pinned staging do not fit the host memory per rank (one line)."""
    taken = model_state_bytes(job.shape)["host_bytes"] if job.shape is not None else 0
    if not taken or job.host_bytes is None:
        return job
    staging = job.offload.staging_bytes()
    if taken + staging > job.host_bytes:
        fraction = job.shape.optimizer_offload_fraction
        most = max(0.0, fraction * (job.host_bytes - staging) / taken)
        raise JobError(f"--optimizer-offload-fraction {fraction:g} puts {size(taken)} of "
                       f"optimizer state in host memory per rank, which with {size(staging)} of "
                       f"pinned staging is more than the {size(job.host_bytes)} there is "
                       f"({job.host_text}): at most {math.floor(most * 100) / 100:g} fits")
    return dataclasses.replace(job, host_bytes=job.host_bytes - taken, host_text=(
        f"{job.host_text}, less {size(taken)} for megatron-core's optimizer CPU offload"))


def as_megatron_runs(base: ModelShape, fields: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron's arguments ``fields`` (ModelShape fields) over ``base`` as Megatron runs them:
    with a tensor-parallel size of 1, sequence parallelism is turned off with one warning
    (Megatron's ``validate_args`` does the same), not refused."""
    tp = fields.get("tp", base.tp)
    if tp == 1 and fields.get("sequence_parallel", base.sequence_parallel):
        log.warning("sequence parallelism turned off: --tensor-model-parallel-size 1 leaves "
                    "nothing to split the sequence over (Megatron disables it the same way)")
        fields = {**fields, "sequence_parallel": False}
    return fields


def _budget(config: Any, shape: Optional[ModelShape], node: NodeProfile) -> Optional[int]:
    """The runtime's activation budget in bytes (a fraction is of the node's GPU memory)."""
    value = config.activation_budget_bytes
    if value is None:
        return None
    if isinstance(value, float) and value <= 1:
        return round(value * node.gpu_memory_bytes)
    return int(value)


__all__ = ["HOST_ENGINES", "Job", "JobError", "Settings", "as_megatron_runs", "has_budget",
           "job_settings", "less_optimizer_host"]
