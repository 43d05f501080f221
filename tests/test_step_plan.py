"""The budgeted planner (plan.step_plan), on synthetic measurements: pure decisions, pinned.

Four layers of 1 s forward and 100 bytes each (their input, kept when recomputed: 10 bytes);
backward takes 2 s per layer.
"""

import itertools

import pytest

from ssdtrain_megatron.plan.policy import KEEP, OFFLOAD, RECOMPUTE, LayerMeasurement
from ssdtrain_megatron.plan.step_plan import Position, format_plan, plan_step, simulate

LAYERS = [LayerMeasurement(forward_s=1.0, activation_bytes=100, checkpoint_bytes=10) for _ in range(4)]
FAST = 1e6  # bytes/s: the round trip hides behind any layer
SLOW = 10.0  # bytes/s: 10 s per layer each way
ONE = [Position()]


def test_no_budget_keeps_everything_whatever_the_drive():
    for bw in (FAST, SLOW):
        plan = plan_step(LAYERS, [Position(), Position(gap_s=3.0, live=2)], write_bps=bw, read_bps=bw,
                         budget_bytes=None, recompute_fallback=True)
        assert plan.decisions == ((KEEP,) * 4, (KEEP,) * 4)
        assert plan.extra_s == 0.0 and plan.allowance_bytes is None


def test_fast_drive_offloads_what_the_budget_cannot_keep_and_keeps_the_rest():
    plan = plan_step(LAYERS, ONE, write_bps=FAST, read_bps=FAST, budget_bytes=200, recompute_fallback=True)
    assert plan.decisions == ((OFFLOAD, OFFLOAD, KEEP, KEEP),)
    assert plan.kept_bytes == (200,)
    assert plan.extra_s == 0.0 and plan.fits_budget


def test_slow_drive_recomputes_instead_of_stalling():
    plan = plan_step(LAYERS, ONE, write_bps=SLOW, read_bps=SLOW, budget_bytes=220, recompute_fallback=True)
    assert plan.decisions == ((RECOMPUTE, RECOMPUTE, KEEP, KEEP),)
    assert plan.extra_s == 2.0  # one extra forward per recomputed layer
    assert plan.kept_bytes == (220,)


def test_slow_drive_without_recompute_still_meets_the_budget_and_predicts_the_stall():
    plan = plan_step(LAYERS, ONE, write_bps=SLOW, read_bps=SLOW, budget_bytes=200)
    assert plan.decisions == ((OFFLOAD, OFFLOAD, KEEP, KEEP),)
    assert plan.fits_budget and plan.extra_s > 0


def test_a_costly_hand_over_on_the_training_thread_makes_recompute_cheaper_than_offload():
    cheap = plan_step(LAYERS, ONE, write_bps=FAST, read_bps=FAST, budget_bytes=310,
                      recompute_fallback=True, cpu_s_per_byte=0.001)
    dear = plan_step(LAYERS, ONE, write_bps=FAST, read_bps=FAST, budget_bytes=310,
                     recompute_fallback=True, cpu_s_per_byte=0.1)
    assert cheap.decisions == ((OFFLOAD, KEEP, KEEP, KEEP),)
    assert dear.decisions == ((RECOMPUTE, KEEP, KEEP, KEEP),)


def test_micro_batches_whose_backward_comes_later_offload_more_and_give_up_the_last_layer():
    """A micro-batch whose backward waits for other forwards (a pipeline's warm-up) has time to
    hide its writes, and its last layer is not kept for an immediate backward."""
    medium = 50.0  # 2 s per layer each way
    plan = plan_step(LAYERS, [Position(gap_s=8.0), Position()], write_bps=medium, read_bps=medium,
                     budget_bytes=110, recompute_fallback=True)
    assert plan.decisions == ((OFFLOAD, OFFLOAD, OFFLOAD, KEEP), (OFFLOAD, OFFLOAD, RECOMPUTE, KEEP))
    assert plan.kept_bytes == (100, 110) and plan.fits_budget
    tight = plan_step(LAYERS, [Position(gap_s=8.0), Position()], write_bps=medium, read_bps=medium,
                      budget_bytes=50, recompute_fallback=True)
    assert tight.decisions[0][3] != KEEP and tight.kept_bytes[0] <= 50
    assert tight.decisions[1][3] == KEEP and not tight.fits_budget  # kept for its backward


def test_live_micro_batches_share_the_budget():
    plan = plan_step(LAYERS, [Position(live=2)], write_bps=FAST, read_bps=FAST, budget_bytes=400)
    assert plan.allowance_bytes == 200
    assert plan.decisions == ((OFFLOAD, OFFLOAD, KEEP, KEEP),)


def _must_fit(layers, positions, budget: int, reserve: int, keep_last_layers: int = 1) -> bool:
    """Whether some plan meets the budget, worked out here and not by the planner: every layer
    but the ones the runtime keeps anyway (the last ``keep_last_layers`` where backward follows
    at once) can be offloaded to 0 resident bytes, so a position fits iff those fit its share."""
    free = max(0, budget - reserve)
    for pos in positions:
        tail = layers[len(layers) - keep_last_layers:] if pos.gap_s == 0 else []
        if sum(layer.activation_bytes for layer in tail) > free // pos.live:
            return False
    return True


@pytest.mark.parametrize("bw,fallback", list(itertools.product((FAST, 50.0, SLOW), (False, True))))
def test_the_budget_is_respected_or_the_plan_says_it_does_not_fit(bw, fallback):
    """Broken variants (``fits = False`` / ``fits = True`` just before plan_step's last return):
    "budget 111, reserve 0, 1 positions: a plan fits, the planner says it does not" and "budget
    0, reserve 0, 1 positions: no plan fits, the planner says one does". The check it replaced
    looked at the bytes only ``if plan.fits_budget`` and passed the first."""
    layers = [LayerMeasurement(forward_s=0.5 + i % 3, activation_bytes=60 + 40 * (i % 4), checkpoint_bytes=8)
              for i in range(6)]
    seen = set()
    for budget in range(0, 900, 37):
        for reserve in (0, 120):
            for positions in ([Position()], [Position(gap_s=2.0, live=3), Position(live=2), Position()]):
                plan = plan_step(layers, positions, write_bps=bw, read_bps=bw, budget_bytes=budget,
                                 reserve_bytes=reserve, recompute_fallback=fallback)
                where = f"budget {budget}, reserve {reserve}, {len(positions)} positions"
                must = _must_fit(layers, positions, budget, reserve)
                assert plan.fits_budget == must, (f"{where}: a plan fits, the planner says it does not" if must
                                                  else f"{where}: no plan fits, the planner says one does")
                seen.add(must)
                assert len(plan.kept_bytes) == len(positions)
                if must:
                    for pos, kept in zip(positions, plan.kept_bytes):
                        assert kept * pos.live <= max(0, budget - reserve), where
                # Never more freed than needed: keeping costs no time.
                assert plan.extra_s >= 0
    assert seen == {True, False}, "the sweep must meet budgets that fit and budgets that do not"


def test_the_plan_prints_as_a_table_of_layers_by_micro_batch_position():
    plan = plan_step(LAYERS, [Position(gap_s=8.0), Position()], write_bps=FAST, read_bps=FAST,
                     budget_bytes=200)
    text = format_plan(plan, ["1", "2", "3", "4"])
    assert text.splitlines()[0].split() == ["layer", "mb0", "mb1"]
    assert len(text.splitlines()) == 5


def test_simulate_counts_recompute_and_stalls():
    assert simulate(LAYERS, [KEEP] * 4, SLOW, SLOW) == 0.0
    assert simulate(LAYERS, [RECOMPUTE, KEEP, KEEP, KEEP], SLOW, SLOW) == 1.0
    assert simulate(LAYERS, [KEEP, KEEP, OFFLOAD, KEEP], SLOW, SLOW) > 0


def test_bad_measurements_are_refused():
    with pytest.raises(ValueError, match="write_bps"):
        plan_step(LAYERS, ONE, write_bps=0, read_bps=1, budget_bytes=1)
    with pytest.raises(ValueError, match="positions"):
        plan_step(LAYERS, [], write_bps=1, read_bps=1, budget_bytes=1)
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_step(LAYERS, ONE, write_bps=1, read_bps=1, budget_bytes=-1)
