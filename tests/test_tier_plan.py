"""The four-place planner (plan/tiers.py) on synthetic layers: pure decisions, pinned.

Four layers of 1 s forward and 100 bytes each (their input, kept when recomputed: 10 bytes);
backward takes 2 s per layer, so one micro-batch computes for 12 s.
"""

import math

import pytest

from ssdtrain_megatron.plan.policy import OFFLOAD, LayerMeasurement
from ssdtrain_megatron.plan.step_plan import Position
from ssdtrain_megatron.plan.tiers import (HOST, KEEP, RECOMPUTE, SSD, Tiers, plan_tiers, price,
                                          timeline)

LAYERS = [LayerMeasurement(forward_s=1.0, activation_bytes=100, checkpoint_bytes=10)
          for _ in range(4)]
FAST = 1e6  # bytes/s: any round trip hides behind one layer
ONE = [Position()]


def tiers(**changes):
    base = dict(budget_bytes=200, host_capacity_bytes=1000, host_link_bps=FAST,
                ssd_write_bps=FAST, ssd_read_bps=FAST)
    base.update(changes)
    return Tiers(**base)


def test_no_budget_keeps_everything():
    plan = plan_tiers(LAYERS, [Position(), Position(gap_s=3.0, live=2)], tiers(budget_bytes=None))
    assert plan.decisions == ((KEEP,) * 4,) * 2
    assert plan.stall_s == 0 and plan.iteration_s == plan.compute_s == 24.0
    assert plan.binding == "nothing"


def test_host_takes_the_first_movable_layers_and_the_drives_the_next_once_host_is_full():
    """The budget holds two layers. Kept last, they are freed first in backward and make room
    to read the moved ones ahead; kept around moved ones, they leave no room, and each read
    waits until backward needs it (a stall, however fast the link)."""
    roomy = plan_tiers(LAYERS, ONE, tiers())
    assert roomy.decisions == ((HOST, HOST, KEEP, KEEP),)
    assert price(LAYERS, ONE, tiers(), [(KEEP, HOST, HOST, KEEP)]).stall_s == pytest.approx(2e-4)
    full = plan_tiers(LAYERS, ONE, tiers(host_capacity_bytes=100))
    assert full.decisions == ((HOST, SSD, KEEP, KEEP),)
    assert full.tier_bytes == {KEEP: 200, HOST: 100, SSD: 100, RECOMPUTE: 0}
    assert full.peak_bytes == 200 and full.host_peak_bytes == 100
    assert full.stall_s == 0 and full.iteration_s == 12.0


def test_a_slow_drive_with_full_host_memory_recomputes_and_host_memory_binds():
    plan = plan_tiers(LAYERS, ONE, tiers(host_capacity_bytes=100, ssd_write_bps=10,
                                         ssd_read_bps=10))
    assert plan.decisions == ((HOST, RECOMPUTE, RECOMPUTE, KEEP),)
    assert plan.recompute_s == 2.0 and plan.stall_s == 0 and plan.iteration_s == 14.0
    assert plan.tier_bytes[RECOMPUTE] == 180 and plan.tier_bytes[KEEP] == 120
    assert plan.binding == "host memory"


def test_without_recompute_the_slow_drive_stalls_and_binds():
    plan = plan_tiers(LAYERS, ONE, tiers(host_capacity_bytes=100, ssd_write_bps=10,
                                         ssd_read_bps=10, places=(KEEP, HOST, SSD)))
    assert plan.decisions == ((HOST, SSD, KEEP, KEEP),)
    assert plan.stall_s > 0 and plan.iteration_s == plan.work_s + plan.stall_s
    assert plan.binding == "the drives"


def test_micro_batches_share_the_drives_so_the_iteration_pays_for_their_bytes():
    """Eight micro-batches, each with a long gap before its backward: each one's own timeline
    hides its writes and reads, but together they need more of the drives than the iteration
    lasts. The iteration is the drives' time, the stall is not 0, and the bandwidth needed is
    above what the drives have; with drives twice as fast, no stall. (Each micro-batch writes
    300 bytes at 40 B/s and reads them at 60 B/s: 12.5 s of the drives' time per 12 s of
    compute, 100 s for the 96 s iteration.) Without a budget no forward waits for a write."""
    positions = [Position(gap_s=100.0, live=1)] * 8
    rows = [(SSD, SSD, SSD, KEEP)] * 8
    slow = price(LAYERS, positions, tiers(budget_bytes=None, host_capacity_bytes=0,
                                          ssd_write_bps=40.0, ssd_read_bps=60.0), rows)
    assert all(timeline(LAYERS, row, 100.0, slow.tiers).stall_s == 0 for row in slow.decisions)
    assert slow.ssd_bytes == 8 * 300 and slow.work_s == 96.0
    assert slow.iteration_s == pytest.approx(100.0) and slow.stall_s == pytest.approx(4.0)
    bw = slow.bandwidth_bps()[SSD]
    assert bw["needed"] > bw["available"] and bw["used"] == pytest.approx(bw["available"])
    assert slow.binding == "the drives"
    fast = price(LAYERS, positions, tiers(budget_bytes=None, host_capacity_bytes=0,
                                          ssd_write_bps=80.0, ssd_read_bps=120.0), rows)
    assert fast.stall_s == 0 and fast.bandwidth_bps()[SSD]["needed"] <= \
        fast.bandwidth_bps()[SSD]["available"]


def test_the_drives_bytes_also_cross_the_host_link():
    """No host memory: the drives take the bytes, and the host link they bounce over, the
    slower of the two, is what the iteration waits on."""
    positions = [Position(gap_s=100.0)] * 8
    plan = plan_tiers(LAYERS, positions, tiers(budget_bytes=100, host_capacity_bytes=0,
                                               host_link_bps=20.0, places=(KEEP, HOST, SSD)))
    assert plan.link_bytes == plan.ssd_bytes == 8 * 300
    assert plan.iteration_s >= 8 * 300 / 20.0 and plan.stall_s > 0
    assert plan.binding == "the host link"


def test_live_micro_batches_share_host_memory_and_the_gpu_budget():
    two = [Position(gap_s=12.0, live=2)] * 2
    plan = plan_tiers(LAYERS, two, tiers(budget_bytes=400, host_capacity_bytes=200))
    assert all(row.count(HOST) == 1 for row in plan.decisions)  # 200 // 2 live
    assert plan.host_peak_bytes == 200 <= plan.tiers.host_capacity_bytes
    assert plan.peak_bytes <= 400


def test_a_budget_nothing_can_meet_says_gpu_memory_binds():
    plan = plan_tiers(LAYERS, ONE, tiers(budget_bytes=50))
    assert not plan.fits_budget and plan.binding == "GPU memory"
    assert plan.decisions[0][-1] == KEEP  # the last layer's backward follows at once


def test_places_follow_the_engine_and_recompute_setting():
    host_only = plan_tiers(LAYERS, ONE, tiers(places=(KEEP, HOST)))
    assert set(host_only.decisions[0]) <= {KEEP, HOST}
    ssd_only = plan_tiers(LAYERS, ONE, tiers(places=(KEEP, SSD)))
    assert set(ssd_only.decisions[0]) == {KEEP, SSD}
    assert ssd_only.as_offload_decisions() == ((OFFLOAD, OFFLOAD, KEEP, KEEP),)
    none = plan_tiers(LAYERS, ONE, tiers(places=(KEEP,)))
    assert none.decisions == ((KEEP,) * 4,) and not none.fits_budget


def test_bandwidth_reports_each_tier_against_what_it_has():
    plan = plan_tiers(LAYERS, ONE, tiers(host_capacity_bytes=100, ssd_write_bps=300.0,
                                         ssd_read_bps=600.0))
    bw = plan.bandwidth_bps()
    assert bw[HOST]["available"] == FAST
    assert bw[SSD]["available"] == pytest.approx(200.0)  # 1 / (1/300 + 1/600)
    assert (bw[SSD]["write_available"], bw[SSD]["read_available"]) == (300.0, 600.0)
    assert bw[HOST]["used"] == pytest.approx(plan.link_bytes / plan.iteration_s)


@pytest.mark.parametrize("changes, message", [
    ({"host_link_bps": -1.0}, "Tiers.host_link_bps=-1.0 is invalid"),
    ({"budget_bytes": 1.5}, "Tiers.budget_bytes=1.5 is invalid"),
    ({"places": ("keep", "nvme")}, "Tiers.places=('keep', 'nvme') is invalid: allowed: keep"),
    ({"ssd_read_bps": math.nan}, "Tiers.ssd_read_bps=nan is invalid"),
])
def test_bad_tiers_are_refused_by_field(changes, message):
    with pytest.raises(ValueError) as info:
        tiers(**changes)
    assert message in str(info.value)


def test_empty_layers_or_positions_are_refused():
    with pytest.raises(ValueError, match="positions is empty"):
        plan_tiers(LAYERS, [], tiers())
    with pytest.raises(ValueError, match="live >= 1"):
        plan_tiers(LAYERS, [Position(live=0)], tiers())


def test_a_write_still_under_way_when_backward_comes_is_forwarded_not_read():
    """No budget, drives at 25 B/s (4 s per layer each way), three layers to the SSD: the forward
    ends at 4 s with all 300 bytes still being written (resident: the peak counts them; writes
    end at 5, 9 and 13 s). Read-ahead stops at a layer whose write is under way, as the
    runtime's does (cache/reads.py, issue 57): at the backward's start (4 s) layer 2 is still
    being written, so nothing is read ahead; backward wants layer 2 at 6 s and layer 1 at 8 s,
    both still being written: forwarded from memory, used at once while their writes go on.
    Layer 0 (written at 5 s) is read as backward enters layer 1 (8 s), behind the drive's last
    write (13 s): 4 s of read, backward waits from 10 s to 17 s. Broken variants: every layer
    read back after its write: ssd_read_bytes 300, stall 15 s; read-ahead taking a layer whose
    write runs (as before issue 57): ssd_read_bytes 0, stall 0."""
    slow = tiers(budget_bytes=None, ssd_write_bps=25.0, ssd_read_bps=25.0)
    cost = timeline(LAYERS, (SSD, SSD, SSD, KEEP), 0.0, slow)
    assert (cost.ssd_bytes, cost.ssd_read_bytes, cost.lagging_bytes) == (300, 100, 300)
    assert cost.stall_s == pytest.approx(7.0, abs=1e-3)
    # With reads as fast as a layer's backward (2 s each at 50 B/s; writes end at 3, 5, 7 s):
    # layer 2 is still being written when backward wants it (6 s): forwarded; layers 1 and 0
    # are read ahead then (7-9 s and 9-11 s behind the last write), and backward waits 1 s
    # for layer 1.
    quick = timeline(LAYERS, (SSD, SSD, SSD, KEEP), 0.0, tiers(budget_bytes=None, ssd_write_bps=50.0,
                                                               ssd_read_bps=50.0))
    assert quick.ssd_read_bytes == 200 and quick.stall_s == pytest.approx(1.0, abs=1e-3)
    plan = plan_tiers(LAYERS, ONE, slow)
    assert plan.decisions == ((KEEP,) * 4,)  # no budget: nothing moves
    priced = price(LAYERS, ONE, slow, [(SSD, SSD, SSD, KEEP)])
    assert priced.peak_bytes == 400 and priced.ssd_read_bytes == 100


def test_under_a_budget_the_forward_waits_for_writes_instead_of_exceeding_it():
    """The same drives with 200 bytes allowed: saving layer 2 would hold 300 (two writes under
    way and itself), so the forward waits for layer 0's write (5 s), and layer 3 for layer 1's
    (9 s): 5 s of stall in forward, and the forward ends holding 200 bytes, never more.
    Backward starts at 9 s: layer 2 (written at 13 s) is forwarded, layers 1 and 0 are read
    back behind it: 2 + 2 + 2 s more. Broken variant (no waits): 400 bytes held at the
    forward's end."""
    slow = tiers(budget_bytes=None, ssd_write_bps=25.0, ssd_read_bps=25.0)
    cost = timeline(LAYERS, (SSD, SSD, SSD, KEEP), 0.0, slow, cap=200)
    assert cost.lagging_bytes == 100 and cost.resident_bytes(1) == 200
    assert cost.stall_s == pytest.approx(11.0, abs=1e-3)
    assert cost.ssd_read_bytes == 200
    budgeted = price(LAYERS, ONE, tiers(budget_bytes=200, reserve_bytes=100, ssd_write_bps=25.0,
                                        ssd_read_bps=25.0), [(SSD, SSD, SSD, KEEP)])
    assert budgeted.stall_s > 0 and budgeted.peak_bytes == 200 and budgeted.fits_budget


def test_the_room_beside_kept_layers_follows_their_order():
    """A budget of three layers: keeping the last three and moving the first fits, since the
    moved layer is saved and read back while only the layers before it (none) are kept; keeping
    the first three and moving the last does not: it comes back beside all three."""
    plan = plan_tiers(LAYERS, ONE, tiers(budget_bytes=300))
    assert plan.decisions == ((HOST, KEEP, KEEP, KEEP),)
    assert plan.fits_budget and plan.peak_bytes == 300 and plan.stall_s == 0
    late = price(LAYERS, ONE, tiers(budget_bytes=300), [(KEEP, KEEP, KEEP, HOST)])
    assert not late.fits_budget and late.peak_bytes == 400
    # what is saved outside the layers (the reserve) comes off the budget
    assert plan_tiers(LAYERS, ONE, tiers(budget_bytes=300, reserve_bytes=100)).decisions == \
        ((HOST, HOST, KEEP, KEEP),)


@pytest.mark.parametrize("write_bps, live, expected", [
    (10.0, 1, 460),   # 3 layers x 100 B, 4 s of forward at 10 B/s: 300 - 40 = 260, + 2 x 100 read ahead
    (FAST, 1, 300),   # drives faster than the forward: one layer's bytes (100), + 200 read ahead
    (10.0, 2, 720),   # two live micro-batches: 600 written, 80 taken (520), + 200 read ahead
])
def test_staging_is_what_the_drives_have_not_taken_when_the_forward_ends_plus_the_reads_ahead(
        write_bps, live, expected):
    """Three layers on the drives, the last kept: the SSD tier writes 300 B per micro-batch while
    its forward takes 4 s (four layers of 1 s); the drives write ``write_bps``. Staging holds
    what they have not taken when the forward ends (at least one layer's bytes), plus
    prefetch_layers (2) layers read back through it."""
    plan = price(LAYERS, [Position(live=live)], tiers(ssd_write_bps=write_bps, budget_bytes=None),
                 [[SSD, SSD, SSD, KEEP]])
    assert plan.staging_bytes == expected


def test_reads_ahead_stay_within_the_runtimes_byte_cap_and_staging_follows_the_window():
    """Drives at 50 B/s both ways, writes done long before backward (a 100 s gap): a layer's
    read (2 s) is as long as its backward, so the runtime reads ahead by time past
    prefetch_layers 1 (plan/readahead.py: a read a little over a backward, so three layers). With max_inflight_bytes of one layer
    (100 B) one read is ahead at a time, and backward waits for each; staging holds the reads
    of the window the runtime opens, within that cap (issue 57). Broken variants: the byte cap
    ignored in tier_costs.ask: the same stall as without it (4 s); staging by prefetch_layers:
    200 bytes, not 400."""
    drive = dict(budget_bytes=None, ssd_write_bps=50.0, ssd_read_bps=50.0, prefetch_layers=1)
    row = (SSD, SSD, SSD, KEEP)
    free = timeline(LAYERS, row, 100.0, tiers(**drive))
    capped = timeline(LAYERS, row, 100.0, tiers(**drive, max_inflight_bytes=100))
    assert free.ssd_read_bytes == capped.ssd_read_bytes == 300
    assert capped.stall_s > free.stall_s
    gap = [Position(gap_s=100.0)]
    assert price(LAYERS, gap, tiers(**drive), [row]).staging_bytes == 100 + 3 * 100
    assert price(LAYERS, gap, tiers(**drive, max_inflight_bytes=100), [row]).staging_bytes == 100 + 100
    with pytest.raises(ValueError, match=r"^Tiers.max_inflight_bytes=0 is invalid"):
        tiers(max_inflight_bytes=0)
