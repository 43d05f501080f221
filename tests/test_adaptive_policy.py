"""The adaptive keep / offload / recompute decision, on synthetic timings.

Four layers of 1 s forward and 100 bytes each; backward takes 2 s per layer. The forward ends
at t=4, so the backward of layer i starts at 4 + 2 * (3 - i) when nothing stalls.
"""

import math

import pytest

from ssdtrain_megatron.plan.policy import (KEEP, OFFLOAD, RECOMPUTE, LayerMeasurement,
                                           plan_layers, should_replan, simulate_micro_batch)

LAYERS = [LayerMeasurement(forward_s=1.0, activation_bytes=100) for _ in range(4)]
FAST = 1000.0  # bytes/s: 0.1 s per layer each way
SLOW = 50.0  # bytes/s: 2 s per layer each way


def test_fast_disk_offloads_all_but_the_last_layer():
    plan = plan_layers(LAYERS, write_bps=FAST, read_bps=FAST, num_micro_batches=8)
    assert plan.decisions == (OFFLOAD, OFFLOAD, OFFLOAD, KEEP)
    assert plan.io_stall_s == 0.0
    assert plan.recompute_s == 0.0
    assert plan.resident_bytes == 100
    assert plan.offloaded_bytes == 8 * 300
    assert plan.fits_budget


def test_keep_last_layers_are_never_offloaded():
    plan = plan_layers(LAYERS, write_bps=math.inf, read_bps=math.inf, keep_last_layers=2)
    assert plan.decisions == (OFFLOAD, OFFLOAD, KEEP, KEEP)
    assert plan.layers(KEEP) == [2, 3]


def test_slow_disk_keeps_layers_whose_round_trip_cannot_hide():
    # Layer 0: written 1..3, read 4..6, needed at 10. Layer 1: written 3..5, read 5..7,
    # needed at 8. Layer 2 would be written 5..7 and read 7..9 but is needed at 6: kept.
    plan = plan_layers(LAYERS, write_bps=SLOW, read_bps=SLOW)
    assert plan.decisions == (OFFLOAD, OFFLOAD, KEEP, KEEP)
    assert plan.io_stall_s == 0.0
    assert plan.resident_bytes == 200
    assert plan.offloaded_bytes == 200


def test_slow_disk_recomputes_instead_when_allowed():
    plan = plan_layers(LAYERS, write_bps=SLOW, read_bps=SLOW, recompute_fallback=True,
                       num_micro_batches=2)
    assert plan.decisions == (OFFLOAD, OFFLOAD, RECOMPUTE, KEEP)
    assert plan.io_stall_s == 0.0
    assert plan.recompute_s == 2.0  # 1 s per micro-batch
    assert plan.resident_bytes == 100


def test_very_slow_disk_keeps_everything():
    plan = plan_layers(LAYERS, write_bps=1.0, read_bps=1.0)
    assert plan.decisions == (KEEP, KEEP, KEEP, KEEP)
    assert plan.offloaded_bytes == 0
    assert plan.resident_bytes == 400


def test_offloading_the_third_layer_on_a_slow_disk_stalls_three_seconds():
    # Reads 2: 7..9 (needed at 6: wait 3), 1: 9..11 (at 11), 0: 11..13 (at 13).
    assert simulate_micro_batch(LAYERS, [OFFLOAD, OFFLOAD, OFFLOAD, KEEP], SLOW, SLOW) == (3.0, 0.0)
    assert simulate_micro_batch(LAYERS, [OFFLOAD, OFFLOAD, KEEP, KEEP], SLOW, SLOW) == (0.0, 0.0)


def test_no_budget_pressure_keeps_everything():
    plan = plan_layers(LAYERS, write_bps=FAST, read_bps=FAST, memory_budget_bytes=400)
    assert plan.decisions == (KEEP, KEEP, KEEP, KEEP)
    assert plan.offloaded_bytes == 0
    assert plan.resident_bytes == 400


def test_budget_keeps_as_much_as_it_allows_and_offloads_earliest_layers():
    plan = plan_layers(LAYERS, write_bps=FAST, read_bps=FAST, memory_budget_bytes=250)
    assert plan.decisions == (OFFLOAD, OFFLOAD, KEEP, KEEP)
    assert plan.resident_bytes == 200
    assert plan.io_stall_s == 0.0


def test_tight_budget_on_slow_disk_picks_recompute_when_cheaper_than_stall():
    # Offloading layer 2 would stall 3 s; recomputing it costs its 1 s forward.
    plan = plan_layers(LAYERS, write_bps=SLOW, read_bps=SLOW, memory_budget_bytes=100,
                       recompute_fallback=True)
    assert plan.decisions == (OFFLOAD, OFFLOAD, RECOMPUTE, KEEP)
    assert plan.io_stall_s == 0.0
    assert plan.recompute_s == 1.0
    assert plan.resident_bytes == 100


def test_tight_budget_without_recompute_accepts_the_stall():
    plan = plan_layers(LAYERS, write_bps=SLOW, read_bps=SLOW, memory_budget_bytes=100,
                       num_micro_batches=4)
    assert plan.decisions == (OFFLOAD, OFFLOAD, OFFLOAD, KEEP)
    assert plan.io_stall_s == 12.0
    assert plan.fits_budget


def test_recompute_beats_a_costlier_stall_but_not_a_cheaper_one():
    cheap = [LayerMeasurement(forward_s=1.0, activation_bytes=100, recompute_s=2.5)
             for _ in range(4)]
    plan = plan_layers(cheap, write_bps=SLOW, read_bps=SLOW, memory_budget_bytes=100,
                       recompute_fallback=True)
    assert plan.decisions == (OFFLOAD, OFFLOAD, RECOMPUTE, KEEP)
    dear = [LayerMeasurement(forward_s=1.0, activation_bytes=100, recompute_s=3.5)
            for _ in range(4)]
    plan = plan_layers(dear, write_bps=SLOW, read_bps=SLOW, memory_budget_bytes=100,
                       recompute_fallback=True)
    assert plan.decisions == (OFFLOAD, OFFLOAD, OFFLOAD, KEEP)
    assert plan.io_stall_s == 3.0


def test_budget_below_the_kept_layers_is_reported_as_not_fitting():
    plan = plan_layers(LAYERS, write_bps=FAST, read_bps=FAST, memory_budget_bytes=50)
    assert plan.decisions == (OFFLOAD, OFFLOAD, OFFLOAD, KEEP)
    assert plan.resident_bytes == 100
    assert not plan.fits_budget


def test_recomputed_layers_keep_their_checkpoint_bytes():
    layers = [LayerMeasurement(forward_s=1.0, activation_bytes=100, checkpoint_bytes=10)
              for _ in range(4)]
    plan = plan_layers(layers, write_bps=1.0, read_bps=1.0, recompute_fallback=True)
    assert plan.decisions == (RECOMPUTE, RECOMPUTE, RECOMPUTE, KEEP)
    assert plan.resident_bytes == 130
    assert plan.recompute_s == 3.0


def test_large_early_layer_is_kept_while_smaller_later_ones_are_offloaded():
    layers = [LayerMeasurement(forward_s=1.0, activation_bytes=b) for b in (1000, 100, 100, 100)]
    plan = plan_layers(layers, write_bps=SLOW, read_bps=SLOW)
    assert plan.decisions == (KEEP, OFFLOAD, KEEP, KEEP)


@pytest.mark.parametrize("kwargs, message", [
    (dict(write_bps=0.0), "write_bps=0.0 is invalid"),
    (dict(read_bps=-1.0), "read_bps=-1.0 is invalid"),
    (dict(num_micro_batches=0), "num_micro_batches=0 is invalid"),
    (dict(keep_last_layers=-1), "keep_last_layers=-1 is invalid"),
    (dict(memory_budget_bytes=-5), "memory_budget_bytes=-5 is invalid"),
])
def test_invalid_policy_inputs_name_the_parameter(kwargs, message):
    args = dict(write_bps=FAST, read_bps=FAST)
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        plan_layers(LAYERS, **args)
    assert message in str(err.value)


def test_replan_when_io_wait_exceeds_the_threshold():
    assert should_replan(0.5, 10.0, 0.02, 1e9, 1e9)
    assert not should_replan(0.1, 10.0, 0.02, 1e9, 1e9)


def test_replan_when_bandwidth_moves_either_way():
    assert should_replan(0.0, 10.0, 0.02, 1e9, 0.5e9)
    assert should_replan(0.0, 10.0, 0.02, 1e9, 2e9)
    assert not should_replan(0.0, 10.0, 0.02, 1e9, 1.2e9)
    assert should_replan(0.0, 10.0, 0.02, 1e9, 1.2e9, bandwidth_change=0.1)
