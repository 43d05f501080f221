"""No preset makes a job slower than the best without offload on the node it names (issue 66,
item 1): every GPU preset's policy is planned (adaptive: keep what fits, and where keep does not
fit, the planner's per-layer places within what the model state leaves), so on every built-in
node, at micro-batch 1, 2 and 4 and the GPU counts the presets and the README document, the
job's plan through the one sequence (plan/job.py ``job_settings``, the function the pre-flight
and install() run too) is never slower than keep, or than Megatron's own full recompute, where
those fit (within the model's error: 2%, plan/explore.py's ``min_gain``).

The grid runs in about two seconds, so the default suite runs all of it. cpu-tiny (the demo's
CPU preset, engine posix named to show the SSD path) is not a GPU job and is left out.
"""

from __future__ import annotations

import contextlib
import io
from typing import Iterator, List, Tuple

import pytest

from ssdtrain_megatron.plan.job import JobError, Settings, job_settings
from ssdtrain_megatron.plan.node import BUILTIN
from ssdtrain_megatron.plan.stage import full_recompute_fits
from ssdtrain_megatron.tools.cli import build_parser
from ssdtrain_megatron.tools.plan.cli import FitAnswered, plan_job

GPU_PRESETS = ("gpt3-1.3b", "llama2-13b", "llama2-7b", "llama3-70b", "llama3-8b-128k",
               "llama3-8b-dgx", "llama3-8b", "mixtral-8x7b", "qwen3-30b-a3b")
GPU_COUNTS = (8, 64, 512)
"""The README's table plans 8, 64 and 512 GPUs; the presets' own layouts are 2 to 64."""
MODEL_ERROR = 1.02
"""A plan within 2% of another is as fast (plan/explore.py ``min_gain``, the README's table)."""


def settings_of(argv: List[str]) -> Settings:
    """The settings of ``ssdtrain plan ARGV`` (its Job through job_settings); FitAnswered or
    ValueError where the job does not fit or is not a valid size."""
    args = build_parser().parse_args(["plan"] + argv)
    with contextlib.redirect_stdout(io.StringIO()):  # a job that does not fit prints its answer
        job, _, _ = plan_job(args)
    return job_settings(job)


def grid() -> Iterator[Tuple[str, str, int, int]]:
    for preset in GPU_PRESETS:
        for node in BUILTIN:
            for gpus in GPU_COUNTS:
                for b in (1, 2, 4):
                    yield preset, node, gpus, b


def slower_than_without_offload(s: Settings) -> Tuple[float, str]:
    """(this plan's time over the fastest of keep and full recompute that fit, which), or
    (0, '') where neither fits."""
    st, plan = s.stage, s.plan
    keep_peak = st.layer_bytes * len(st.layers) * st.positions[0].live + st.head_bytes
    refs = []
    if keep_peak <= s.plan_budget_bytes:
        refs.append((st.keep_iteration_s, "keep"))
    if full_recompute_fits(st, s.plan_budget_bytes):
        refs.append((st.recompute_iteration_s, "full recompute"))
    if not refs:
        return 0.0, ""
    best, name = min(refs)
    return plan.iteration_s / best, name


def test_no_preset_plans_slower_than_keep_or_recompute_on_any_node():
    planned, slower = 0, []
    for preset, node, gpus, b in grid():
        try:
            s = settings_of(["--config", preset, "--node", node, "--gpus", str(gpus),
                             "--micro-batch-size", str(b)])
        except (FitAnswered, ValueError, JobError):
            continue  # does not fit, or not a layout of these GPUs: nothing runs to compare
        planned += 1
        ratio, against = slower_than_without_offload(s)
        if ratio > MODEL_ERROR:
            slower.append(f"{preset} {node} {gpus} GPUs b={b}: x{ratio:.3f} {against} "
                          f"(policy {s.planned_policy}, engine {s.config.engine})")
    assert slower == []
    assert planned == 411  # the jobs of the grid that fit: the grid is not empty by accident


def test_the_issue_llama3_8b_job_plans_as_fast_as_keep():
    """`plan --config llama3-8b --node dgx-h100 --gpus 8 --global-batch-size 64
    --micro-batch-size 2` put every layer in host memory at x1.998 keep on a975649."""
    s = settings_of(["--config", "llama3-8b", "--node", "dgx-h100", "--gpus", "8",
                     "--global-batch-size", "64", "--micro-batch-size", "2"])
    assert s.config.policy == "adaptive"
    assert s.places == ("keep",) * 16
    assert s.plan.stall_s == 0 and s.plan.recompute_s == 0
    assert s.plan.iteration_s == pytest.approx(s.stage.keep_iteration_s, rel=1e-12)


def test_a_named_offload_policy_still_offloads():
    """--policy offload (the job's --ssd-offload-policy offload) is the user's: kept as named."""
    s = settings_of(["--config", "llama3-8b", "--node", "dgx-h100", "--gpus", "8",
                     "--global-batch-size", "64", "--micro-batch-size", "2", "--policy",
                     "offload"])
    assert s.config.policy == "offload"
    assert s.places == ("host",) * 16


def test_adaptive_without_a_budget_where_keep_does_not_fit_gets_the_plans_budget():
    """Keep does not fit llama3-8b-128k on 8 H100s at b=1: the runtime's budget is what the
    model state leaves (the plan's), and the plan places layers within it."""
    s = settings_of(["--config", "llama3-8b-128k", "--node", "dgx-h100", "--gpus", "16",
                     "--micro-batch-size", "1"])
    assert s.planned_policy == "adaptive"
    assert s.config.activation_budget_bytes == s.plan_budget_bytes
    assert s.budget_bytes == s.plan_budget_bytes
    assert s.plan.peak_bytes + s.stage.head_bytes <= s.plan_budget_bytes
    assert "do not fit" in s.notes[-1]


@pytest.mark.parametrize("preset", ("llama3-70b",))
def test_policy_keep_is_measured_against_the_gpu_not_the_presets_fraction(preset):
    """llama3-70b's preset budget is 0.35 of GPU memory; policy keep applies no budget, so its
    plan is measured against what the model state leaves."""
    keep = settings_of(["--config", preset, "--node", "dgx-h100", "--gpus", "64",
                        "--policy", "keep"])
    held = settings_of(["--config", preset, "--node", "dgx-h100", "--gpus", "64"])
    assert held.plan_budget_bytes == round(0.35 * BUILTIN["dgx-h100"].gpu_memory_bytes)
    assert keep.plan_budget_bytes > held.plan_budget_bytes
