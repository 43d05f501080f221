"""The excess of a step over its bound, split by cause (telemetry/breakdown.py), on synthetic
timelines whose every part is known by hand; the fair bounds (telemetry/bounds.py) against
hand-computed cases; the interval algebra under both (telemetry/intervals.py).

The timelines are made through the real Timeline (telemetry/timeline.py) with a host clock and
a GPU clock the test sets: a GPU event is "issued" at the host time and "runs" at the GPU time
the test chooses, as a stream running behind the host would."""

from __future__ import annotations

import pytest

from ssdtrain_megatron.telemetry import breakdown as bd
from ssdtrain_megatron.telemetry.bounds import BOTH_WAYS, SCHEDULE, drive_bound, link_bound, stall_beyond_deficit
from ssdtrain_megatron.telemetry.intervals import intersect, length, partition, subtract, union
from ssdtrain_megatron.telemetry.timeline import Timeline

MS = 1_000_000  # ns


class _Event:
    def __init__(self, gpu: "GpuClock") -> None:
        self.gpu, self.ms = gpu, None

    def record(self, stream) -> None:
        self.ms = self.gpu.ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_Event") -> float:
        return end.ms - self.ms


class GpuClock:
    """StreamOps-shaped: timing events take the GPU time the test set."""

    def __init__(self) -> None:
        self.ms = 0.0

    def timing_event(self) -> _Event:
        return _Event(self)

    def current_stream(self, device):
        return "compute"


class Synthetic:
    """A timeline whose host and GPU times the test gives, in milliseconds."""

    def __init__(self) -> None:
        self.host_ns = 0
        self.gpu = GpuClock()
        self.tl = Timeline(self.gpu, "cpu", clock=lambda: self.host_ns)
        self.tl.start()

    def host(self, name: str, cat: str, a: float, b: float, **args) -> None:
        self.tl.span(name, cat, int(a * MS), int(b * MS), **args)

    def gpu_span(self, track: str, name: str, cat: str, issued: tuple, ran: tuple, **args) -> None:
        self.host_ns, self.gpu.ms = int(issued[0] * MS), ran[0]
        token = self.tl.gpu_begin("s", track, name, cat, **args)
        self.host_ns, self.gpu.ms = int(issued[1] * MS), ran[1]
        self.tl.gpu_end("s", token)

    def gpu_mark(self, track: str, name: str, cat: str, issued: float, ran: float) -> None:
        self.host_ns, self.gpu.ms = int(issued * MS), ran
        self.tl.gpu_mark("s", track, name, cat)

    def drive(self, op: str, a: float, b: float, nbytes: int) -> None:
        self.tl.on_io(op, 1, "/slab", 0, nbytes, a / 1e3, b / 1e3, 1)

    def done(self, step_ms: float) -> list:
        self.host("step", "step", 0, step_ms)
        self.host_ns = int(step_ms * MS)
        self.tl.stop()
        return self.tl.events


def test_union_intersect_subtract_and_the_priority_partition():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert length(union([(0, 4), (2, 6)])) == 6
    parts = partition((0, 10), [("a", [(1, 4)]), ("b", [(3, 6), (8, 20)]), ("a", [(0, 1)])], "rest")
    assert parts == {"a": 4, "b": 4, "rest": 2}  # b's (3, 4) was a's already


def _drive_bound_step(step_ms: float = 1000.0):
    """A posix step, 1 s on its timeline, bound 0.5 s by its drive: busy 0.6 s (0.1 s slower
    than assumed), idle before its first chunk (0.1 s), after its last (0.2 s), while the
    training thread waited for a read (50 ms), ran pack (30 ms; an IO thread's concurrent
    span counts for nothing), paused for the collector (10 ms), and did something else (10 ms)."""
    s = Synthetic()
    s.drive("write", 100, 300, 1 << 30)
    s.drive("write", 250, 400, 1 << 29)  # overlapping chunks: busy is their union
    s.drive("read", 500, 800, 1 << 30)
    s.host("read", "wait", 400, 450, record=3)
    s.host("pack", "hook", 450, 480, record=4, bytes=1 << 20)
    s.host("gc", "gc", 480, 490)
    s.tl.events.append(dict(s.tl.events[-2], tid="ssdtrain-io-0", ts=490_000.0, dur=10_000.0))  # an IO thread
    # a memory engine's pool copy has its own drive row ("write host memory"): not the drive
    s.tl.on_io("write", 9, "<host memory>", 0, 1 << 20, 0.0, 0.05, 1)
    return s.done(step_ms)


def test_a_drive_bound_step_splits_its_excess_into_the_parts_made_by_hand():
    events = _drive_bound_step()
    bound = drive_bound(0.2, 1e9, 1e9, 4e9, 4e9)  # 0.25 + 0.25 s: the drive binds
    assert (bound.seconds, bound.resource) == (0.5, "drive")
    row = bd.breakdown(events, 1.0, bound)
    want = {"drive slower than assumed": 0.1, bd.HEAD: 0.1, bd.TAIL: 0.2, bd.blocked("read"): 0.05,
            bd.HOST_CPU: 0.03, bd.GC: 0.01, "drive idle while the host was busy": 0.01}
    assert row["parts"] == pytest.approx(want, abs=1e-9)
    assert row["excess_s"] == pytest.approx(0.5) and row["sum_s"] == pytest.approx(0.5)
    assert row["typical"] is True and row["gap_s"] == pytest.approx(0.0, abs=1e-9)
    # only the 10 ms idle with no cause on the host names no cause: 2% of the 0.5 s excess
    assert row["unexplained_s"] == pytest.approx(0.01) and row["explained"] is True
    assert row["unexplained_parts"] == ["drive idle while the host was busy"]
    assert row["host_blocked_s"] == {"read": pytest.approx(0.05)}
    io = row["io"]
    assert io["drive_write"]["bytes"] == 3 << 29 and io["drive_write"]["busy_s"] == pytest.approx(0.3)
    assert io["drive_read"]["gbps"] == pytest.approx((1 << 30) / 0.3 / 1e9)


def test_a_timeline_step_far_from_the_median_does_not_add_up():
    """The parts cover the timeline's step (1 s); the median step was 1.5 s: the 0.5 s they
    leave unexplained is more than 10% of the 1.0 s excess."""
    row = bd.breakdown(_drive_bound_step(), 1.5, drive_bound(0.2, 1e9, 1e9, 4e9, 4e9))
    assert row["typical"] is False and row["gap_s"] == pytest.approx(0.5)
    assert row["explained"] is True  # what the trace shows is explained: the two rows judge apart
    none = bd.breakdown(_drive_bound_step(), 0.505, drive_bound(0.2, 1e9, 1e9, 4e9, 4e9))
    assert none["typical"] is None and none["explained"] is None


def test_an_excess_the_causes_do_not_name_is_not_explained_though_the_parts_add_up():
    """The drive idle 300 ms while the training thread did nothing the timeline names: the
    parts still tile the window (typical), but 0.31 s of the 0.5 s excess names no cause."""
    s = Synthetic()
    s.drive("write", 100, 300, 1 << 30)
    s.drive("write", 250, 400, 1 << 29)
    s.drive("read", 700, 1000, 1 << 30)
    row = bd.breakdown(s.done(1000), 1.0, drive_bound(0.2, 1e9, 1e9, 4e9, 4e9))
    assert row["parts"]["drive idle while the host was busy"] == pytest.approx(0.3)
    assert row["typical"] is True and row["unexplained_s"] == pytest.approx(0.3)
    assert row["explained"] is False  # 60% of the excess > 20%


def _link_step():
    """Memory engine: D2H [0, 40] ms, H2D [30, 70] ms, 1 GB each way over 100 ms of step."""
    s = Synthetic()
    s.gpu_span("offload", "d2h", "copy", (0, 1), (0, 40), record=1, bytes=10**9)
    s.gpu_span("reload", "h2d", "copy", (20, 21), (30, 70), record=1, bytes=10**9)
    return s.done(100)


LINK = {"d2h": 25e9, "h2d": 25e9, "both": 40e9}


def test_a_link_bound_step_splits_the_link_by_direction_and_the_directions_not_overlapped():
    """25 GB/s each way, 40 GB/s both at once: (W + R) / both-ways binds at 50 ms. Busy is the
    union, 70 ms: each direction alone moved its 0.75 GB in 30 ms (its measured rate: nothing
    slower), both at once 0.5 GB in 10 ms (2.5 ms faster than 40 GB/s); what is left is the
    directions not overlapped: 30 + 30 + 12.5 - 50 = 22.5 ms. The tail, 30 ms."""
    bound = link_bound(0.02, 1e9, 1e9, LINK["d2h"], LINK["h2d"], LINK["both"])
    assert (bound.formula, bound.resource, bound.note) == (BOTH_WAYS, "link", "")
    assert bound.seconds == pytest.approx(0.05)
    row = bd.breakdown(_link_step(), 0.1, bound, assumed=LINK)
    assert row["parts"] == pytest.approx({bd.NOT_OVERLAPPED: 0.0225, bd.BOTH_SLOWER: -0.0025, bd.TAIL: 0.03})
    io = row["io"]
    assert io["link_overlap_s"] == pytest.approx(0.01)
    assert io["d2h"]["gbps"] == pytest.approx(25.0) and io["d2h"]["assumed_gbps"] == 25.0
    assert io["link_d2h_alone"]["bytes"] == pytest.approx(0.75e9) and io["link_d2h_alone"]["gbps"] == pytest.approx(25)
    assert io["link_both"]["gbps"] == pytest.approx(50.0) and io["link_both"]["assumed_gbps"] == 40.0
    assert row["typical"] is True and row["explained"] is True
    # a slower D2H alone is its own part: the same copy over 60 ms
    s = Synthetic()
    s.gpu_span("offload", "d2h", "copy", (0, 1), (0, 60), record=1, bytes=10**9)
    s.gpu_span("reload", "h2d", "copy", (20, 21), (50, 90), record=1, bytes=10**9)
    parts = bd.breakdown(s.done(100), 0.1, bound, assumed=LINK)["parts"]
    assert parts["D2H alone slower than measured"] == pytest.approx(0.05 - 1e9 * 5 / 6 / 25e9)  # 50 ms alone
    # without the both-ways rate the link's slowness is one part, as before
    row = bd.breakdown(_link_step(), 0.1, bound, assumed={"d2h": 25e9, "h2d": 25e9})
    assert row["parts"] == pytest.approx({"link slower than assumed": 0.02, bd.TAIL: 0.03})


def test_one_micro_batch_reads_after_its_writes_and_the_bound_says_the_schedule_binds():
    """With one micro-batch every byte read is written first: R / D2H + R / H2D = 80 ms is a
    floor, above both-ways' 50 ms; the bound names it and says both-ways is unreachable. The
    same step is then 10 ms inside the link's bound, its excess the tail."""
    bound = link_bound(0.02, 1e9, 1e9, LINK["d2h"], LINK["h2d"], LINK["both"], reads_after_writes=True)
    assert (bound.formula, bound.resource) == (SCHEDULE, "link") and bound.seconds == pytest.approx(0.08)
    assert bound.note.startswith("both-ways unreachable") and "the schedule, not the link" in bound.note
    row = bd.breakdown(_link_step(), 0.1, bound, assumed=LINK)
    assert row["note"] == bound.note
    assert row["parts"] == pytest.approx({bd.NOT_OVERLAPPED + " beyond what the schedule allows": -0.0075,
                                          bd.BOTH_SLOWER: -0.0025, bd.TAIL: 0.03})
    # reads a third of the writes: the schedule's 2 x 13.3 ms is under both-ways' 53.3: no note
    b = link_bound(0.02, 1e9, 1e9 / 3, LINK["d2h"], LINK["h2d"], LINK["both"], reads_after_writes=True)
    assert b.formula == "W / D2H" and b.note == "" and b.terms[SCHEDULE] == pytest.approx(2 / 75)


def _keep_step():
    """keep: forward [5, 30] ms, backward reached at 60, optimizer [80, 95], step 100 ms."""
    s = Synthetic()
    s.gpu_span("compute", "forward layer 1", "layer", (0, 10), (5, 30))
    s.gpu_mark("compute", "backward layer 1", "layer", 40, 60)
    s.gpu_span("compute", "optimizer", "phase", (70, 72), (80, 95))
    return s.done(100)


def _offload_step(read_wait=(35, 55)):
    """The same step with offload, 130 ms: pack at 10-12 ms while the GPU is still busy with
    the forward (it ran dry at 30): no cost; the training thread blocked on a read from 35 to
    55 with the stream dry since 30: 20 ms idle; the stream waited 10 ms on a reload; the
    optimizer ended at 115: a 15 ms tail."""
    s = Synthetic()
    s.gpu_span("compute", "forward layer 1", "layer", (0, 10), (5, 30))
    s.host("pack", "hook", 10, 12, record=1)
    s.host("read", "wait", *read_wait, record=1)
    s.gpu_span("compute", "reload", "wait", (55, 55.5), (56, 66), record=1)
    s.gpu_mark("compute", "backward layer 1", "layer", 58, 70)
    s.gpu_span("compute", "optimizer", "phase", (90, 92), (100, 115))
    return s.done(130)


def test_a_compute_bound_step_is_split_against_keeps_own_timeline():
    bound = link_bound(0.1, 1e8, 1e8, 50e9, 50e9, 80e9)  # keep's 100 ms binds
    assert (bound.formula, bound.resource) == ("keep", "compute")
    row = bd.breakdown(_offload_step(), 0.13, bound, keep_events=_keep_step())
    want = {bd.TAIL: 0.010, bd.RELOAD: 0.010, bd.GPU_IDLE + bd.blocked("read"): 0.020, bd.COMPUTE: -0.010}
    assert row["parts"] == pytest.approx(want, abs=1e-9)
    assert row["excess_s"] == pytest.approx(0.03) and row["typical"] is True
    assert row["explained"] is True  # compute beyond keep's is negative: nothing unexplained


def test_a_compute_bound_excess_in_slower_kernels_is_not_explained():
    """The wait of the test above costs nothing, so 10 ms of the 30 ms excess is the compute
    stream beyond keep's: a third of it names no cause."""
    row = bd.breakdown(_offload_step(read_wait=(12, 28)), 0.13, link_bound(0.1, 1, 1, 1e9, 1e9, 1e9),
                       keep_events=_keep_step())
    assert row["typical"] is True and row["unexplained_s"] == pytest.approx(0.01)
    assert row["explained"] is False and row["unexplained_parts"] == [bd.COMPUTE]


def test_fair_bounds_against_hand_computed_cases():
    # 2 GB written, 1 GB read; 50 GB/s D2H, 40 GB/s H2D, 60 GB/s both ways at once
    b = link_bound(0.01, 2e9, 1e9, 50e9, 40e9, 60e9)
    assert b.terms == pytest.approx({"keep": 0.01, "W / D2H": 0.04, "R / H2D": 0.025, "(W + R) / both-ways": 0.05})
    assert (b.seconds, b.formula, b.io_s) == (pytest.approx(0.05), "(W + R) / both-ways", pytest.approx(0.05))
    # both ways at once twice as fast as one: the writes bind
    b = link_bound(0.01, 2e9, 1e9, 50e9, 40e9, 100e9)
    assert (b.formula, b.resource, b.seconds) == ("W / D2H", "d2h", pytest.approx(0.04))
    # a drive does one thing at a time: 2 GB at 2 GB/s + 1 GB at 4 GB/s
    d = drive_bound(0.3, 2e9, 1e9, 2e9, 4e9)
    assert (d.seconds, d.resource, d.io_s) == (pytest.approx(1.25), "drive", pytest.approx(1.25))
    assert drive_bound(2.0, 2e9, 1e9, 2e9, 4e9).formula == "keep"
    # blocked 1.0 s of a step whose IO needs 1.25 s and keep 0.3 s: 0.05 s beyond the 0.95 s deficit
    assert stall_beyond_deficit(1.0, 1.25, 0.3) == pytest.approx(0.05)
    assert stall_beyond_deficit(0.5, 1.25, 0.3) == 0.0
    assert stall_beyond_deficit(0.02, 0.1, 0.3) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="d2h_bps=0 is invalid"):
        link_bound(0.01, 1, 1, 0, 1, 1)
