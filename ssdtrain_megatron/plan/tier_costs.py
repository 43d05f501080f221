"""The four places and what they cost: :class:`Tiers` (what a GPU's node offers and which
places a plan may use), :func:`timeline` (one micro-batch under one row of places), and
:class:`TierPlan` (the result of ``plan.tiers.plan_tiers``). Pure: no torch, no IO.

What each place costs, per micro-batch (the timeline of ``plan.policy``, with two tiers):

* keep: no time; the bytes stay in GPU memory until the layer's backward.
* host: the bytes cross the host link (GPU -> host) in forward, queued behind earlier writes,
  and back (host -> GPU) in backward; they occupy host memory in between.
* ssd: the same crossing of the host link (the offloader bounces drive IO through pinned host
  memory), and in series the drive's write, later its read. A drive does one thing at a time:
  its writes and reads share its time.
* recompute: one extra forward of the layer in backward; its input stays in GPU memory.
* host and ssd also cost the training thread ``cpu_s_per_byte`` per byte handed over.

Reads go in reverse layer order, each no earlier than its write completed and than the runtime
asks for it (as backward reaches the layer the read-ahead window above it, or at the
backward's start for the last ones: the window by time, at least ``prefetch_layers``, as the
runtime sizes it, ``_readahead``); under a budget a read ahead also waits until its bytes fit
beside what the micro-batch still holds (the runtime reads ahead less, cache/budget.py), except
the one backward needs now, and within the runtime's read-ahead byte cap
(``max_inflight_bytes``). Read-ahead stops at a layer whose write is still under way, as the
runtime's does (cache/reads.py): asked for then, it would be taken from memory and its write
spent for nothing. A read that completes after its layer's backward is due stalls for
the difference. A layer whose write has not completed when the runtime asks for it is still in
GPU memory: when backward itself wants it, the runtime forwards it from there
(cache/transfers.py): backward uses it at once while the write goes on (the drive still
carries it, and the reads queue behind it), and nothing is read back. The bytes still being written when the forward ends are
resident then too (``PositionCost.lagging_bytes``): a drive too slow for its layers does not
free their memory.
Under a budget the forward waits for the oldest writes instead of exceeding it (cache/budget.py);
those waits are stall.

Micro-batches overlap in a pipeline, so each position's own timeline sees the whole bandwidth;
what they share is checked for the whole iteration: every resource (each direction of the host
link, the drives) must carry its bytes within the iteration. The iteration time is the larger
of the compute with each position's stalls and the busiest resource's time, so a plan that
needs more bandwidth than a tier has never reports 0 stall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .policy import KEEP, OFFLOAD, RECOMPUTE, LayerMeasurement
from .readahead import readahead_layers

HOST = "host"
SSD = "ssd"
PLACES = (KEEP, HOST, SSD, RECOMPUTE)
"""The four places, nearest first."""

BINDING = ("GPU memory", "host memory", "the host link", "the drives")
"""What ``TierPlan.binding`` may name (or "nothing": the plan costs no time over keep)."""

REL_EPS = 1e-9
"""Relative slack on time comparisons, so that float rounding never reads as a stall."""


def _check_rate(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or value < 0:
        raise ValueError(f"Tiers.{name}={value!r} is invalid: expected bytes/s >= 0 "
                         "(0: no such tier; math.inf: unlimited)")


@dataclass(frozen=True)
class Tiers:
    """What one GPU has for activations, and which places the plan may use."""

    budget_bytes: Optional[int]
    """GPU activation bytes allowed at once, all live micro-batches together; None: no limit
    (everything is kept: keeping costs no time)."""
    host_capacity_bytes: int = 0
    """Host memory for this GPU's activations."""
    host_link_bps: float = 0.0
    """Bytes/s between GPU and host memory in each direction; the SSD tier crosses it too."""
    ssd_write_bps: float = 0.0
    """Drive write bytes/s this GPU gets."""
    ssd_read_bps: float = 0.0
    """Drive read bytes/s this GPU gets."""
    reserve_bytes: int = 0
    """Part of the budget held by what is not planned here (tensors saved outside the layers:
    embedding, head, loss). What the layers need beside what they keep (a layer saved, read
    back or re-created after kept ones) is the plan's own: :func:`need_bytes`."""
    places: Tuple[str, ...] = PLACES
    """Places the plan may use (keep always): the engine's tiers, recompute if allowed."""
    bubble_s: float = 0.0
    """Time of the iteration outside these layers (the pipeline bubble, the output layer):
    counted in the iteration, and IO runs during it."""
    cpu_s_per_byte: float = 0.0
    """Training-thread seconds per byte handed to the host or SSD tier."""
    backward_factor: float = 2.0
    """Backward time of a layer as a multiple of its forward time."""
    keep_last_layers: int = 1
    """Where backward follows the forward at once (gap 0), the last N layers stay kept."""
    max_inflight_bytes: Optional[int] = None
    """The runtime's read-ahead byte cap (OffloadConfig.max_inflight_bytes): reads ahead of
    backward stop where they would pass it (one always goes); None: no cap."""
    prefetch_layers: int = 2
    """The read-ahead window's start and floor (OffloadConfig.prefetch_layers): how far ahead
    of backward the runtime asks for a layer is as wide as the reads need to arrive in time,
    at least this (``_readahead``, plan/readahead.py). A layer whose write has not completed
    when it is asked for is forwarded from memory."""

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "host_capacity_bytes", "reserve_bytes", "keep_last_layers",
                     "prefetch_layers"):
            value = getattr(self, name)
            if value is None and name == "budget_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Tiers.{name}={value!r} is invalid: expected an integer >= 0")
        for name in ("host_link_bps", "ssd_write_bps", "ssd_read_bps"):
            _check_rate(name, getattr(self, name))
        for name in ("bubble_s", "cpu_s_per_byte"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Tiers.{name}={getattr(self, name)!r} is invalid: expected >= 0")
        cap = self.max_inflight_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"Tiers.max_inflight_bytes={cap!r} is invalid: expected an integer "
                             ">= 1 or None")
        if not self.backward_factor > 0:
            raise ValueError(f"Tiers.backward_factor={self.backward_factor!r} is invalid: "
                             "expected > 0")
        unknown = [p for p in self.places if p not in PLACES]
        if unknown:
            raise ValueError(f"Tiers.places={self.places!r} is invalid: allowed: "
                             + ", ".join(PLACES))

    def usable(self) -> Tuple[str, ...]:
        """The places a layer may leave keep for: allowed, and with a nonzero rate."""
        ok = []
        if HOST in self.places and self.host_link_bps > 0 and self.host_capacity_bytes > 0:
            ok.append(HOST)
        if SSD in self.places and self.host_link_bps > 0 and self.ssd_write_bps > 0 \
                and self.ssd_read_bps > 0:
            ok.append(SSD)
        if RECOMPUTE in self.places:
            ok.append(RECOMPUTE)
        return tuple(ok)


@dataclass(frozen=True)
class PositionCost:
    """One micro-batch position's timeline under one row of places."""

    stall_s: float
    recompute_s: float
    cpu_s: float
    host_bytes: int
    ssd_bytes: int
    kept_bytes: int
    lagging_bytes: int
    """Host and SSD bytes whose writes are still under way when the forward ends (resident)."""
    host_read_bytes: int
    """Host bytes read back (the rest were forwarded from memory: backward came first)."""
    ssd_read_bytes: int
    """SSD bytes read back, likewise."""
    need_bytes: int = 0
    """The most its layers hold at once: :func:`need_bytes`, or more where writes still under
    way are held beside a layer being saved, or reads ahead beside what backward holds (under
    a budget the forward waits for the one and backward cuts the other short)."""

    def resident_bytes(self, live: int) -> int:
        """GPU activation bytes when ``live`` micro-batches are held: each keeps its kept
        bytes, and the newest also what its writes have not finished."""
        return live * self.kept_bytes + self.lagging_bytes


@dataclass(frozen=True)
class TierPlan:
    """Places per (position, layer) and what the model predicts for one iteration."""

    decisions: Tuple[Tuple[str, ...], ...]
    """decisions[position][layer]: 'keep', 'host', 'ssd' or 'recompute', forward order."""
    compute_s: float
    """Forward and backward of every micro-batch, plus the bubble: the iteration keeping all."""
    recompute_s: float
    """Extra forward time of recomputed layers, all positions."""
    cpu_s: float
    """Training-thread time handing bytes to the tiers, all positions."""
    stall_s: float
    """Time the iteration waits on the host link or the drives (0 only when every resource
    carries its bytes in time)."""
    iteration_s: float
    """compute + recompute + cpu + stall: the modeled time of one iteration."""
    tier_bytes: Dict[str, int]
    """Bytes per iteration in each place (keep: resident, recomputed layers' inputs included;
    recompute: what recomputation re-creates)."""
    link_bytes: int
    """Bytes per iteration over the host link in each direction (host and SSD tiers)."""
    ssd_bytes: int
    """Bytes per iteration written to the drives."""
    ssd_read_bytes: int
    """Bytes per iteration read back from the drives (not those forwarded from memory)."""
    peak_bytes: int
    """GPU activation bytes at the worst moment: the most any position's live micro-batches
    hold (the others' kept bytes beside its own :func:`need_bytes`), plus the reserve; without
    a budget, at least what they
    keep with the bytes still being written when the forward ends (a budget waits for those
    writes instead: their time is stall)."""
    host_peak_bytes: int
    """Host memory at the worst moment, likewise."""
    staging_bytes: int
    """Pinned host staging the SSD tier needs on a GPU (OffloadConfig.pinned_staging_bytes):
    the SSD-tier bytes the live micro-batches write that the drives have not taken yet when
    the last of them ends its forward (the device memory goes when the copy into staging
    lands; staging holds the rest), at least one layer's, plus a read-ahead window of layers
    read back through it; 0 when nothing goes to the drives."""
    binding: str
    """What limits the plan: one of :data:`BINDING`, or "nothing"."""
    fits_budget: bool
    """False when even moving every movable layer leaves a position above its GPU share (its
    live micro-batches' kept bytes beside its need), or the reserve alone is over the budget."""
    tiers: Tiers = field(repr=False)
    """What the plan was made for (rates, capacities, allowed places)."""

    def layers(self, place: str, position: int = 0) -> List[int]:
        return [i for i, d in enumerate(self.decisions[position]) if d == place]

    def bytes_per_micro_batch(self) -> Dict[str, int]:
        """tier_bytes averaged over the positions (exact when they are all alike)."""
        n = len(self.decisions)
        return {k: v // n for k, v in self.tier_bytes.items()}

    @property
    def work_s(self) -> float:
        """The iteration without stalls."""
        return self.compute_s + self.recompute_s + self.cpu_s

    def bandwidth_bps(self) -> Dict[str, Dict[str, float]]:
        """Per tier: ``used`` (bytes/s flowing over the iteration), ``needed`` (to carry the
        bytes without stalling) and ``available``. The host link counts each direction; the
        drives carry each byte once each way, so their ``available`` is the rate of each way
        when writes and reads share their time: 1 / (1/write + 1/read)."""
        t = self.tiers
        drive = 1 / (1 / t.ssd_write_bps + 1 / t.ssd_read_bps) if t.ssd_write_bps > 0 \
            and t.ssd_read_bps > 0 else 0.0
        # The drives' bytes as round trips: what they were busy with, at the shared rate (all
        # of ssd_bytes when everything written is read back).
        trips = (self.ssd_bytes / t.ssd_write_bps + self.ssd_read_bytes / t.ssd_read_bps) * drive \
            if drive else 0.0
        out = {}
        for name, moved, available in ((HOST, self.link_bytes, t.host_link_bps),
                                       (SSD, trips, drive)):
            out[name] = {"used": moved / self.iteration_s if self.iteration_s else 0.0,
                         "needed": moved / self.work_s if self.work_s else 0.0,
                         "available": available}
        out[SSD].update(write_available=t.ssd_write_bps, read_available=t.ssd_read_bps)
        return out

    def as_offload_decisions(self) -> Tuple[Tuple[str, ...], ...]:
        """The plan in the runtime's older words: host and ssd become 'offload' (the engine's
        default tier)."""
        return tuple(tuple(OFFLOAD if d in (HOST, SSD) else d for d in row) for row in self.decisions)


def kept_bytes(layers: Sequence[LayerMeasurement], row: Sequence[str]) -> int:
    """GPU bytes ``row`` keeps through backward: kept layers whole, recomputed ones' inputs."""
    return sum(m.activation_bytes if d == KEEP else m.checkpoint_bytes if d == RECOMPUTE else 0
               for m, d in zip(layers, row))


def _readahead(layers: Sequence[LayerMeasurement], row: Sequence[str], tiers: Tiers) -> int:
    """How many layers ahead the runtime reads under ``row``: by time (plan/readahead.py, as
    cache/reads.py sizes it from what a step measured), from the moved layers' mean bytes and
    read time at these rates and a layer's backward compute."""
    link, r = tiers.host_link_bps, tiers.ssd_read_bps
    moved = [(layer.activation_bytes, place) for layer, place in zip(layers, row) if place in (HOST, SSD)]
    if not moved or link <= 0:
        return tiers.prefetch_layers
    size = sum(b for b, _ in moved) / len(moved)
    read_s = sum(b / link + (b / r if place == SSD and r > 0 else 0.0) for b, place in moved) / len(moved)
    backward_s = tiers.backward_factor * sum(layer.forward_s for layer in layers) / len(layers)
    return readahead_layers(tiers.prefetch_layers, size, size / read_s, backward_s, len(layers))


def timeline(layers: Sequence[LayerMeasurement], row: Sequence[str], gap_s: float,
             tiers: Tiers, cap: Optional[int] = None) -> PositionCost:
    """One micro-batch under ``row``: its forward (writes queued on the host link, SSD writes
    also on the drive), ``gap_s`` of other work, its backward (reads in reverse order).

    ``cap``: the GPU bytes this micro-batch may hold while its forward runs (None: no budget).
    Past it, the forward waits for the oldest writes to complete, as the runtime's budget
    does (cache/budget.py), and the wait is stall."""
    link, w, r = tiers.host_link_bps, tiers.ssd_write_bps, tiers.ssd_read_bps
    clock = cpu = stall = 0.0
    d2h_free = drive_free = 0.0
    done: Dict[int, float] = {}
    host = ssd = kept = 0
    most = 0  # the most the forward holds: kept, the layer being saved, writes under way
    for i, layer in enumerate(layers):
        clock += layer.forward_s
        place, size = row[i], layer.activation_bytes
        own = layer.checkpoint_bytes if place == RECOMPUTE else size
        pending = sorted((t, j) for j, t in done.items() if t > clock)
        held = kept + own + sum(layers[j].activation_bytes for _, j in pending)
        for t, j in pending if cap is not None else ():
            if held <= cap:  # past the cap, the budget waits for the oldest write under way
                break
            stall += t - clock
            clock = t
            held -= layers[j].activation_bytes
        most = max(most, held)
        if place in (HOST, SSD):
            hand = size * tiers.cpu_s_per_byte
            clock += hand
            cpu += hand
            start = max(clock, d2h_free)
            d2h_free = start + size / link
            if place == HOST:
                done[i] = d2h_free
                host += size
            else:
                drive_start = max(start, drive_free)
                drive_free = max(drive_start + size / w, d2h_free)
                done[i] = drive_free
                ssd += size
        elif place == KEEP:
            kept += size
        else:
            kept += layer.checkpoint_bytes
    lagging = sum(layers[i].activation_bytes for i, t in done.items() if t > clock)
    clock += gap_s
    h2d_free = clock
    recompute = 0.0
    host_read = ssd_read = 0
    n = len(layers)
    held = kept  # what this micro-batch holds in backward: kept layers not yet freed, reads
    arrival: Dict[int, float] = {}  # moved layer -> when its bytes are back (0: forwarded)
    nxt = n - 1  # the next layer, in reverse order, whose bytes may be asked for
    early: set = set()  # layers read ahead whose backward has not come: the byte cap's bytes
    ahead_bytes = 0

    def ask(floor: int, now: float, demand: int) -> None:
        """The runtime asks for the moved layers down to ``floor`` (prefetch), in reverse order;
        under the cap a read waits until it fits beside what is held, except the layer
        backward needs now (``demand``)."""
        nonlocal nxt, held, h2d_free, drive_free, host_read, ssd_read, ahead_bytes
        while nxt >= max(floor, 0):
            j = nxt
            place, size = row[j], layers[j].activation_bytes
            if place in (HOST, SSD) and done[j] > now:
                if j != demand:
                    return  # read-ahead stops at a write under way (cache/reads.py)
                arrival[j] = 0.0  # backward wants it: forwarded from memory at once
                held += size
            elif place in (HOST, SSD):
                if j != demand and ((cap is not None and held + size > cap) or (
                        tiers.max_inflight_bytes is not None and ahead_bytes
                        and ahead_bytes + size > tiers.max_inflight_bytes)):
                    return  # read ahead less: asked again when backward frees a layer
                if j != demand:
                    ahead_bytes += size
                    early.add(j)
                if place == HOST:
                    host_read += size
                    h2d_free = max(now, h2d_free, done[j]) + size / link
                else:
                    ssd_read += size
                    drive_start = max(now, drive_free, done[j])
                    drive_free = drive_start + size / r
                    h2d_free = max(max(drive_start, h2d_free) + size / link, drive_free)
                arrival[j] = h2d_free
                held += size
            nxt -= 1

    ahead = _readahead(layers, row, tiers)
    ask(n - ahead, clock, -1)  # the backward's start: the last layers
    for i in reversed(range(n)):
        layer, place, size = layers[i], row[i], layers[i].activation_bytes
        ask(i - ahead, clock, i)
        most = max(most, held)  # a recomputed layer's own bytes: need_bytes
        if arrival.get(i, 0.0) > clock:
            stall += arrival[i] - clock
            clock = arrival[i]
        if place == RECOMPUTE:
            recompute += layer.recompute_cost_s
            clock += layer.recompute_cost_s
        clock += tiers.backward_factor * layer.forward_s
        held -= size if place in (KEEP, HOST, SSD) else layer.checkpoint_bytes
        if i in early:
            ahead_bytes -= size
    return PositionCost(stall, recompute, cpu, host, ssd, kept, lagging, host_read, ssd_read,
                        max(most, need_bytes(layers, row)))


def need_bytes(layers: Sequence[LayerMeasurement], row: Sequence[str]) -> int:
    """The most one micro-batch's layers hold at once under ``row``, writes in flight and reads
    ahead apart (the budget waits for the one and cuts the other): what it keeps at the
    forward's end, or, for a layer it does not keep, what it keeps of the layers before it
    beside that layer's whole bytes (saved in forward, read back or re-created in backward).
    Kept layers late in the forward need no room beyond themselves; a layer moved after kept
    ones needs its own bytes beside them."""
    need = before = 0
    for m, d in zip(layers, row):
        if d != KEEP:
            need = max(need, before + m.activation_bytes)
        before += m.activation_bytes if d == KEEP else m.checkpoint_bytes if d == RECOMPUTE else 0
    return max(need, before)
