"""Measured selection (plan/explore.py): bounded exploration, changes kept only beyond noise,
settling, drift re-exploration; and the candidates it is offered (plan/step_plan.py), each
within the memory budget. Pure: step times are given, not measured."""

from __future__ import annotations

import itertools
import logging

import pytest

from ssdtrain_megatron.plan.explore import EXPLORE, PRIOR, SETTLED, Bounds, MeasuredSelection
from ssdtrain_megatron.plan.policy import KEEP, OFFLOAD, RECOMPUTE, LayerMeasurement
from ssdtrain_megatron.plan.step_plan import Position, candidates, fits


def endless(incumbent):
    """A fresh candidate every time (plans are ints here): the bound alone must stop it."""
    return [(f"plan {incumbent + k}", incumbent + k) for k in range(1, 1000)]


def run(sel, step_time, steps):
    """Feed ``steps`` steps; ``step_time(plan, i)`` is what the step running ``plan`` took."""
    ran = []
    for i in range(steps):
        plan = sel.current
        ran.append(plan)
        sel.observe(step_time(plan, i))
    return ran


def test_exploration_never_exceeds_its_step_bound_and_then_settles_on_the_incumbent():
    """Broken by letting _next ignore explore_steps: 'exploring steps 999 > 12'."""
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=12), endless)
    sel.start("model", 0)
    ran = run(sel, lambda plan, i: 1.0, 200)  # nothing is faster: every candidate rejected
    exploring = sum(1 for p in ran if p != 0)
    assert exploring <= 12, f"exploring steps {exploring} > 12"
    assert exploring == 12  # four candidates of three steps
    assert sel.phase == SETTLED and sel.incumbent == 0
    assert sel.settled_step == 3 + 2 * 12  # each candidate step followed by one of the incumbent
    assert sel.settled_step == sel.bounds.round_steps  # what the bench and gpu-check wait for
    assert all(ran[k] == 0 for k in range(4, 3 + 2 * 12, 2))  # the steps beside them
    assert set(ran[27:]) == {0}  # none after settling


def test_a_candidate_faster_beyond_noise_replaces_the_incumbent_and_the_settled_plan_is_the_fastest():
    """Broken by never adopting (better = False): 'settled on 0, expected 2'."""
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=12, min_gain=0.02), endless)
    sel.start("model", 0)
    times = {0: 1.0, 1: 1.05, 2: 0.80, 3: 0.82, 4: 0.9, 5: 0.85}
    run(sel, lambda plan, i: times.get(plan, 1.5), 100)
    assert sel.settled and sel.incumbent == 2, f"settled on {sel.incumbent}, expected 2"


def test_a_gain_within_min_gain_or_within_the_spread_is_not_taken():
    """Broken by needed = 0: 'took plan 1, a gain within the noise'."""
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=3, min_gain=0.02), endless)
    sel.start("model", 0)
    run(sel, lambda plan, i: 1.0 if plan == 0 else 0.99, 20)  # 1% faster, below 2%
    assert sel.incumbent == 0, "took plan 1, a gain within the noise"
    # 5% faster, but the incumbent's own step times spread by 10% (median absolute deviation)
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=3, min_gain=0.02), endless)
    sel.start("model", 0)
    noisy = itertools.cycle([1.0, 0.9, 1.1])
    run(sel, lambda plan, i: next(noisy) if plan == 0 else 0.95, 20)
    assert sel.incumbent == 0, "took plan 1, a gain within the noise"


def test_a_median_gain_with_one_pair_slower_is_not_taken(caplog):
    """The node emulation's false step (2026-12-04, docs/benchmarks.md): two pairs of three
    3-4% faster, one 0.6% slower, median gain 2.7% over a 2% bar; the plan ran 2.6% slower than
    the model's once settled. Every pair must be faster. Broken by dropping that condition:
    plan 1 is taken."""
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=3, min_gain=0.02), endless)
    sel.start("model", 0)
    candidate = iter([4.603, 4.614, 4.769])
    beside = iter([4.740, 4.733, 4.740])
    with caplog.at_level(logging.INFO, logger="ssdtrain_megatron.plan.explore"):
        run(sel, lambda plan, i: next(candidate, 4.60) if plan == 1 else
            (next(beside, 4.73) if i >= 3 else 4.73), 12)
    assert sel.incumbent == 0, "took plan 1 on two faster pairs of three"
    assert "and every pair faster (1 not): rejected" in caplog.text
    # the same gain on every pair is taken
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=3, min_gain=0.02), endless)
    sel.start("model", 0)
    run(sel, lambda plan, i: 4.60 if plan == 1 else 4.73, 12)
    assert sel.incumbent == 1


def test_a_machine_that_speeds_up_while_exploring_does_not_make_an_equal_plan_look_faster():
    """The incumbent measured while the machine is slow, an equal plan after it sped up by 30%
    (these VMs drift 2x within minutes): each candidate step is compared with the incumbent's
    step beside it, so the drift cancels, and a real gain is still taken. Broken by judging
    against the incumbent's earlier steps (trial times, not the ones beside it): 'took plan 1'."""
    def machine(i):  # slow for the prior's steps, then 30% faster for good
        return 1.0 if i < 3 else 0.7
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=3, min_gain=0.02), endless)
    sel.start("model", 0)
    run(sel, lambda plan, i: machine(i), 20)  # plan 1 costs what plan 0 costs
    assert sel.settled and sel.incumbent == 0, f"took plan {sel.incumbent}: the machine's drift, not the plan"
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=3, min_gain=0.02), endless)
    sel.start("model", 0)
    run(sel, lambda plan, i: machine(i) * (0.9 if plan == 1 else 1.0), 20)  # 10% faster
    assert sel.settled and sel.incumbent == 1
    assert "faster by 10.0% (median of 3 paired steps)" in sel.history[0]


def test_drift_after_settling_starts_one_bounded_re_exploration():
    """Broken by never re-exploring in _watch: 'phase settled after a 40% drift'."""
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=6, drift=0.15), endless)
    sel.start("model", 0)
    run(sel, lambda plan, i: 1.0, 30)  # settles on 0 at step 9
    assert sel.settled and sel.rounds == 1
    # the machine slows down by 40% for the incumbent; plan 2 is now the fastest
    ran = run(sel, lambda plan, i: 1.4 if plan == 0 else 1.0 if plan == 2 else 1.6, 3)
    assert sel.phase == EXPLORE, f"phase {sel.phase} after a 40% drift"
    drifted_at = sel.steps
    ran = run(sel, lambda plan, i: 1.4 if plan == 0 else 1.0 if plan == 2 else 1.6, 60)
    assert sel.rounds == 2 and sel.settled and sel.incumbent == 2
    # the incumbent's last three steps are its new measurement: the round is the bound alone
    # (its 6 steps on other plans, each with the incumbent's step beside it)
    assert sel.settled_step - drifted_at <= 2 * 6
    assert set(ran[sel.settled_step - drifted_at:]) == {2}


def test_the_log_says_the_bound_each_candidate_measured_and_where_it_settled(caplog):
    sel = MeasuredSelection(Bounds(trial_steps=2, explore_steps=4), endless)
    sel.start("model's plan", 0)
    with caplog.at_level(logging.INFO, logger="ssdtrain_megatron"):
        run(sel, lambda plan, i: 1.0 if plan == 0 else 0.5 if plan == 1 else 0.7, 20)
    text = caplog.text
    assert "tried plan 1: median 0.500s" in text and "now the incumbent" in text
    assert "tried plan 2: median 0.700s" in text and "rejected" in text
    assert "settled after 10 steps" in text and "on plan 1: median 0.500s" in text
    assert "against model's plan: median 1.000s (min 1.000, max 1.000, 2 steps) beside it" in text
    assert "model's plan: median 1.000s" in text  # the prior's measurement is in the settle line
    assert "at most 4 steps on other plans" in Bounds(trial_steps=2, explore_steps=4).describe()


def test_no_exploration_steps_settles_on_the_prior_after_measuring_it():
    sel = MeasuredSelection(Bounds(trial_steps=2, explore_steps=0), endless)
    sel.start("model", 7)
    assert sel.phase == PRIOR
    assert set(run(sel, lambda plan, i: 1.0, 10)) == {7} and sel.settled_step == 2


@pytest.mark.parametrize("kwargs", [dict(trial_steps=0), dict(explore_steps=-1), dict(min_gain=1.0),
                                    dict(drift=-0.1)])
def test_bad_bounds_name_the_field(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Bounds(**kwargs)


LAYERS = [LayerMeasurement(forward_s=0.01, activation_bytes=100, checkpoint_bytes=10) for _ in range(4)]
POSITIONS = [Position(gap_s=0.02, live=2), Position(gap_s=0.0, live=2)]


def test_candidates_put_the_whole_plans_first_and_all_of_them_fit_the_budget():
    """Broken by dropping the fits() filter in candidates(): 'all keep' (800 kept bytes) is
    offered under a 300-byte budget: 'over the budget: all keep'."""
    current = ((OFFLOAD,) * 4, (OFFLOAD, OFFLOAD, OFFLOAD, KEEP))
    budget = 300  # 150 per live micro-batch: all keep (400 each) does not fit, all recompute (40) does
    got = candidates(current, LAYERS, POSITIONS, write_bps=1e3, read_bps=1e3, budget_bytes=budget,
                     recompute_fallback=True)
    labels = [label for label, _ in got]
    assert labels[0] == "all recompute"
    assert "all keep" not in labels
    for label, plan in got:
        assert fits(LAYERS, POSITIONS, plan, budget), f"over the budget: {label}"
        kept = [sum(m.activation_bytes if d == KEEP else m.checkpoint_bytes if d == RECOMPUTE else 0
                    for m, d in zip(LAYERS, row)) for row in plan]
        assert max(kept) <= budget // 2, (label, kept)
    # the single changes never touch the last layer of the position whose backward follows at once
    assert not any(label.startswith("mb1 layer 3") for label in labels)
    # without recompute_fallback, no plan recomputes anything
    got = candidates(current, LAYERS, POSITIONS, write_bps=1e3, read_bps=1e3, budget_bytes=None)
    assert "all keep" in [label for label, _ in got]
    assert all(RECOMPUTE not in row for _, plan in got for row in plan)


def test_fits_without_a_budget_and_with_the_reserve():
    plan = ((KEEP,) * 4, (KEEP,) * 4)
    assert fits(LAYERS, POSITIONS, plan, None)
    assert fits(LAYERS, POSITIONS, plan, 800) and not fits(LAYERS, POSITIONS, plan, 800, reserve_bytes=1)


def test_after_rebaseline_the_next_window_is_the_reference_not_a_drift():
    """Broken by making rebaseline() a no-op: 'phase explore after rebaseline'."""
    sel = MeasuredSelection(Bounds(trial_steps=3, explore_steps=3, drift=0.15), endless)
    sel.start("model", 0)
    run(sel, lambda plan, i: 1.0, 10)
    assert sel.settled
    sel.rebaseline()
    run(sel, lambda plan, i: 2.0, 5)  # twice as slow from now on, on purpose
    assert sel.phase == SETTLED and sel.rounds == 1, f"round {sel.rounds} after rebaseline"
    run(sel, lambda plan, i: 3.0, 3)  # then a real drift from the new reference
    assert sel.phase == EXPLORE


def test_where_even_the_current_plan_does_not_fit_only_plans_keeping_no_more_are_offered():
    """The model's plan can miss the budget by its reserve estimate (the runtime's budget still
    holds): its neighbours that free more are worth measuring, those that keep more are not.
    Broken by offering only plans that fit(): 'mb0 layer 0: keep -> offload' missing."""
    current = ((KEEP,) * 4, (OFFLOAD, OFFLOAD, OFFLOAD, KEEP))  # 400 and 100 bytes kept
    budget = 100  # 50 per live micro-batch: current does not fit
    assert not fits(LAYERS, POSITIONS, current, budget)
    got = candidates(current, LAYERS, POSITIONS, write_bps=1e3, read_bps=1e3, budget_bytes=budget,
                     recompute_fallback=True)
    labels = [label for label, _ in got]
    assert labels[0] == "all recompute" and "all keep" not in labels
    assert "mb0 layer 0: keep -> offload" in labels, labels  # 300 kept: less than now, not within 50
    assert not any(label.startswith("mb1") and label.endswith("-> keep") for label in labels), labels
