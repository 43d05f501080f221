"""``ssdtrain plan``'s result: the preset on a node, planned across keep, host, SSD and recompute
(the library's plan/stage.py and plan/tiers.py), as the JSON-ready dict ``plan --json`` prints.

The settings planned are the job's: plan/job.py's :func:`job_settings` (the one sequence the
pre-flight and install() run too) decides engine, policy, recompute fallback, host pool and the
place of each layer; this module only adds what the table and ``--json`` show around them
(tiers, bandwidth, lifespan, the memory, the largest micro-batch), and, where the engine is
named, what the node would have chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

from ...config import OffloadConfig
from ...plan.fit import DEFAULT_JOB_DAYS, beyond_the_node, reserve_bytes
from ...plan.lifespan import RETENTION_FACTOR, WAF, WAF_RATED, ssd_lifespan
from ...plan.memory import activation_budget
from ...plan.model import (head_activation_terms, largest_micro_batch, layer_activation_bytes,
                           layer_activation_terms, peak_activation_bytes)
from ...plan.node import DEFAULT_NODE, NodeProfile, load_profile
from ...plan.placing import places_for, plan_policy
from ...plan.shape import ModelShape, SaveProfile
from ...plan.stage import Stage, full_recompute_fits, plan_stage, stage
from ...plan.job import Job, Settings, job_settings, less_optimizer_host
from ...plan.tiers import PLACES, TierPlan
from .optimizer_offer import optimizer_offload_of

ITERATION_LABEL = ("per iteration: every micro-batch's forward and backward on one GPU of the "
                   "first pipeline stage, with the pipeline bubble")


def node_for(args: argparse.Namespace, preset_node: Optional[NodeProfile]) -> Tuple[NodeProfile, str]:
    """The node planned for, and where it comes from: --node, else the preset's node:
    section, else :data:`DEFAULT_NODE`; then each figure a flag gives replaces the node's."""
    if getattr(args, "node", None) is not None:
        node, source = load_profile(args.node), "--node"
    elif preset_node is not None:
        node, source = preset_node, "the preset's node: section"
    else:
        node, source = load_profile(DEFAULT_NODE), "the default; --node picks another"
    changes: Dict[str, Any] = {}
    for flag, name in (("gpu_tflops", "gpu_tflops"), ("gpu_memory", "gpu_memory_bytes"),
                       ("host_memory", "host_memory_bytes"), ("host_link_gbps", "host_link_gbps"),
                       ("gpus_per_node", "gpus_per_node"), ("drives", "drives"),
                       ("ssd_tbw", "drive_tbw_tb")):
        value = getattr(args, flag, None)
        if value is not None:
            changes[name] = value
    if "gpu_tflops" in changes:  # the flag's figure at every micro-batch, not the profile's table
        changes["gpu_tflops_by_tokens"] = None
        changes["gpu_kind"] = None  # nor its GPU kind's terms (plan/step_time.py)
    if changes.get("drives") == 0:
        changes.update(drive_write_gbps=0.0, drive_read_gbps=0.0, drive_tbw_tb=0.0)
    node = node.replace(**changes) if changes else node
    gbps = getattr(args, "ssd_gbps", None)
    if gbps is not None:  # per GPU, each way: the node's drives together give gpus x that
        per_drive = gbps * node.gpus_per_node / max(node.drives, 1)
        node = node.replace(drives=max(node.drives, 1), drive_write_gbps=per_drive,
                            drive_read_gbps=per_drive,
                            drive_tbw_tb=node.drive_tbw_tb or load_profile(DEFAULT_NODE).drive_tbw_tb)
    if changes or gbps is not None:
        source += ", with flags"
    return node, source


def lifespan(plan: TierPlan, node: NodeProfile) -> Optional[Dict[str, float]]:
    """The node's drives at this plan's write rate (every GPU of the node writing as this one):
    the rated figure, then the paper's relaxed estimate. None when nothing is written."""
    if plan.ssd_bytes == 0 or node.drives == 0:
        return None
    per_node_gbps = plan.ssd_bytes / plan.iteration_s * node.gpus_per_node / 1e9
    life = ssd_lifespan(node.drives, node.drive_tbw_tb, per_node_gbps, 1.0)
    return {"rated_years": life.rated_lifespan_years, "paper_relaxed_years": life.lifespan_years,
            "bytes_per_day_per_node": life.bytes_per_day, "write_gbps_per_node": per_node_gbps,
            "paper_factors": f"WAF correction {WAF_RATED:g}/{WAF:g} x retention factor "
                             f"{RETENTION_FACTOR:g} (the paper's estimates, not a rating)"}


def tier_summary(plan: TierPlan, st: Stage, budget: int) -> Dict[str, Any]:
    """The names a script reads (issue 35): per-tier bytes per micro-batch, bandwidth used,
    needed and available, the iteration against keep and full recompute, peaks and binding.
    ``fits_budget``: the peak (head bytes included) within ``budget``, whatever the policy."""
    peak = plan.peak_bytes + st.head_bytes
    bw = {tier: {k: v / 1e9 for k, v in figures.items()}
          for tier, figures in plan.bandwidth_bps().items()}
    return {
        "tiers": plan.bytes_per_micro_batch(),
        "bandwidth_gbps": bw,
        "stall_s": plan.stall_s,
        "iteration_s": plan.iteration_s,
        "iteration_label": ITERATION_LABEL,
        "compute_s": plan.compute_s,
        "recompute_s": plan.recompute_s,
        "keep_iteration_s": st.keep_iteration_s,
        "recompute_iteration_s": st.recompute_iteration_s,
        "vs_keep": plan.iteration_s / st.keep_iteration_s,
        "vs_recompute": plan.iteration_s / st.recompute_iteration_s,
        "peak_bytes": peak,
        "host_peak_bytes": plan.host_peak_bytes,
        "staging_bytes": plan.staging_bytes,
        "binding": plan.binding,
        "fits_budget": plan.fits_budget and peak <= budget,
    }


def build_plan(job: Job, settings: Settings, args: argparse.Namespace,
               node_source: str = "") -> Dict[str, Any]:
    """The whole plan of ``settings`` (``job_settings(job)``) as a JSON-ready dict (what
    ``ssdtrain plan --json`` prints)."""
    job = less_optimizer_host(job)  # the host memory megatron-core's optimizer offload leaves
    shape, node, profile = job.shape, job.node.replace(host_memory_bytes=job.host_bytes or 0), job.profile
    offload, choice, plan, st = settings.config, settings.choice, settings.plan, settings.stage
    m = settings.num_micro_batches
    policy = settings.planned_policy
    places = places_for(offload.engine, offload.recompute_fallback)
    keep_last, ahead = offload.keep_last_layers, offload.prefetch_layers
    # the budget the plan is measured against (plan/job.py): policy keep applies none, and one
    # job_settings gave an adaptive job without one is what the model state leaves
    held = offload.policy != "keep" and "activation_budget_bytes" in job.given
    memory = activation_budget(shape, node.gpu_memory_bytes,
                               getattr(args, "activation_budget", None) if held else None,
                               offload.activation_budget_bytes if held else None,
                               reserve=reserve_bytes(job.memory_reserve, node.gpu_memory_bytes))
    budget = settings.plan_budget_bytes
    every = plan_stage(st, node, budget_bytes=budget, places=PLACES, keep_last_layers=keep_last,
                       prefetch_layers=ahead)
    plan_node = node.replace(host_memory_bytes=max((job.host_bytes or 0) - offload.staging_bytes(), 0))

    job_days = getattr(args, "job_days", None) or DEFAULT_JOB_DAYS

    def feasible_on_node(p: TierPlan) -> Optional[str]:
        life = lifespan(p, node)
        return beyond_the_node(p.host_peak_bytes, p.staging_bytes, node.host_memory_bytes,
                               life["rated_years"] * 365.25 if life else None, job_days)

    def fits(mode: str):
        def check(b: int) -> bool:
            sized = shape.replace(micro_batch=b)
            if mode == "planned":  # and on the node: host memory, staging, the drives' life
                sized_stage = stage(sized, profile, plan_node, m)
                sized_plan = plan_policy(sized_stage, plan_node, policy, places, budget, offload)
                return tier_summary(sized_plan, sized_stage, budget)["fits_budget"] \
                    and feasible_on_node(sized_plan) is None
            if mode == "recompute":
                return full_recompute_fits(stage(sized, profile, node, m), budget)
            return peak_activation_bytes(sized, "keep", profile) <= budget
        return check

    layer_bytes = layer_activation_bytes(shape, profile)
    summary = tier_summary(plan, st, budget)
    life = lifespan(plan, node)
    result = {
        "config": getattr(args, "config", None) or "the job's launcher arguments (after --)",
        "node": {**node.to_dict(), "ssd_write_gbps": node.ssd_write_gbps,
                 "ssd_read_gbps": node.ssd_read_gbps, "host_copy_gbps": node.host_copy_gbps},
        "node_source": node_source,
        "policy": offload.policy, "planned_policy": policy, "engine": offload.engine,
        "places": list(places), "recompute_fallback": offload.recompute_fallback,
        "settings": settings.summary(), "settings_line": settings.line(),
        "notes": list(settings.notes),
        "engine_choice": {"engine": choice.engine, "followed_the_node": choice.followed,
                          "reason": choice.reason, "host_memory_bytes": offload.host_memory_bytes},
        "model": {name: getattr(shape, name) for name in shape.__dataclass_fields__},
        "layers_per_stage": shape.layers_per_stage,
        "keep_last_layers": keep_last,
        "prefetch_layers": ahead,
        "num_micro_batches": m,
        # Numbered from 1 within the stage, as Megatron numbers layers.
        "layers": [{"layer": i, "bytes": layer_bytes, "decision": d}
                   for i, d in enumerate(plan.decisions[0], start=1)],
        "decisions_per_position": [list(row) for row in plan.decisions],
        "terms_per_layer": layer_activation_terms(shape, profile),
        "activation_bytes_per_layer": layer_bytes,
        "activation_bytes_per_micro_batch": layer_bytes * shape.layers_per_stage
        + sum(head_activation_terms(shape, profile).values()),
        **summary,
        "budget_bytes": budget,
        "staging_default_bytes": offload.staging_bytes(),
        "host_capacity_bytes": plan_node.host_memory_bytes,
        "lifespan_rated_years": life["rated_years"] if life else None,
        "lifespan": life,
        "tp_comm_s_per_layer": st.tp_comm_s,
        "gpu_tflops": node.gpu_tflops,
        "step_time_s": plan.iteration_s,  # older name of iteration_s
        "every_place": {"places": list(PLACES), **tier_summary(every, st, budget)},
        "memory": memory,
        "largest_micro_batch": {mode: largest_micro_batch(fits(mode))
                                for mode in ("keep", "planned", "recompute")},
        "job_days": job_days,
        "beyond_the_node": feasible_on_node(plan),
        "optimizer_offload": optimizer_offload_of(shape, node),
    }
    result["slower_than_the_node"] = None
    if not choice.followed:  # what the node would choose, to say when it plans faster
        default = job_settings(dataclasses.replace(
            job, offload=job.offload.replace(engine=OffloadConfig().engine),
            given={k: v for k, v in job.given.items() if k != "engine"}))
        if default.plan is not None and default.config.engine != offload.engine \
                and default.plan.iteration_s < plan.iteration_s * (1 - 1e-9):
            result["slower_than_the_node"] = {
                "engine": default.config.engine, "reason": default.choice.reason,
                "policy": default.config.policy,
                "places": list(places_for(default.config.engine, default.config.recompute_fallback)),
                "iteration_s": default.plan.iteration_s,
                "vs_keep": default.plan.iteration_s / default.stage.keep_iteration_s}
    return result
