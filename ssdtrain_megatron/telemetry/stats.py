"""Per-step statistics of the offloader: StepStats (what users read) and its accumulator."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Optional, Tuple, Union

from .append import AppendFile

PASS_REASONS = ("recompute", "small", "device", "parameter", "subclass", "layout",
                "held_by_schedule", "cuda_graph_capture", "discarded_graph")
"""Why a saved tensor was left to autograd (StepStats.passed_through_by_reason): saved during
the recompute pass of checkpointing; below min_tensor_bytes; on another device than the
offloader's; a parameter or a view of one; a tensor subclass; a non-strided layout; held until
backward by something else (held.py); saved while a CUDA graph was being captured; saved in a
graph that is dropped before backward (a checkpoint's no-grad forward that turns grad on for a
moment: megatron-core's bias-dropout-add)."""


@dataclass(frozen=True)
class LayerStats:
    """One layer's row in a step (summed over micro-batches)."""

    layer: str
    bytes: int
    """Bytes of activations this layer saved above the size threshold (after dedup)."""
    bytes_offloaded: int
    tensors: int
    decision: str
    """'offload', 'host', 'ssd', 'keep' or 'recompute' (what the plan asked for this layer;
    cache/decisions.py)."""
    io_wait_s: float
    forward_s: float = 0.0
    """Forward compute time of the layer, all micro-batches together."""
    recompute_s: float = 0.0
    """Time of the layer's recompute passes inside backward (its forward run again by a
    checkpoint), all micro-batches together; 0 where the layer was not recomputed."""
    recomputes: int = 0
    """How many recompute passes ``recompute_s`` sums (one per micro-batch recomputed)."""
    backward_s: float = 0.0
    """Host seconds of the layer's backward, all micro-batches together, less the IO waits in
    it: from backward's first unpack in this layer to its first in the layer before (the
    layer backward reaches last in a micro-batch is not timed), and at most the CPU time its
    thread spent there (a wait sleeps: a slow drive does not lengthen it). On a GPU this is what
    the training thread spent launching it; cache/reads.py sizes its read-ahead by it."""
    late_writes: int = 0
    """GPU: the layer's records backward wanted before their device->host copy had landed:
    their copies were spent on bytes backward took from device memory (the offloader then
    defers this layer's writes when its backward follows the forward: cache/decisions.py
    ``late_tail``)."""

    @property
    def recompute_pass_s(self) -> Optional[float]:
        """Seconds of one recompute pass (None: the layer was not recomputed)."""
        return self.recompute_s / self.recomputes if self.recomputes else None


@dataclass(frozen=True)
class StepStats:
    """What one training step did with its activations (docs/stats.md)."""

    step: int
    """This offloader's count of finished steps before this one (0 for its first step); the
    stats JSONL also has ``iteration`` = step + 1, the number the demo prints."""
    bytes_offloaded: int
    """Bytes written to the engine (successfully)."""
    bytes_read: int
    """Bytes read back for backward. Less than bytes_offloaded when tensors were forwarded
    (below) or released without being needed."""
    bytes_deduplicated: int
    """Bytes not written because the same tensor was already recorded."""
    tensors_offloaded: int
    tensors_passed_through: int
    """Saved tensors left to autograd: parameters, small tensors, other devices, subclasses,
    tensors re-created during recomputation."""
    tensors_kept: int
    """Tensors recorded but kept in memory by the plan (the last keep_last_layers layers of a
    micro-batch whose backward comes next, layers the plan keeps)."""
    tensors_forwarded: int
    """Unpacks served from memory without a read (write still in flight, or tensor alive):
    their bytes were written but never read back."""
    io_wait_s: float
    """Time the training threads blocked on IO (back-pressure in forward, reads in backward)."""
    peak_resident_bytes: int
    """Peak bytes of recorded activations held in memory at once."""
    write_gbps: float
    """bytes_offloaded over the time the engine was busy writing (10^9 bytes per second)."""
    read_gbps: float
    """bytes_read over the time the engine was busy reading."""
    bytes_on_disk: int
    """Bytes still on disk after the step (0 unless something leaked)."""
    fallbacks: int
    """Writes that failed (a full disk, an IO error, a storage its owner freed in place before
    the write: record.py ``check_storage``) and were kept in memory instead."""
    step_time_s: float
    """Seconds from the step's first forward to end_step(): forward and backward of all its
    micro-batches."""
    layers: Tuple[LayerStats, ...] = ()
    iteration_time_s: float = 0.0
    """Seconds since the previous end_step() (the first step: since its first forward): the
    whole iteration, optimizer and data loading included. The adaptive planner weighs
    io_wait_s against it."""
    bytes_wasted: int = 0
    """bytes_offloaded that were never read back: forwarded from memory because something else
    still held the tensor at backward, or released unread. Each spent drive bandwidth and
    endurance and freed no memory (docs/stats.md)."""
    bytes_wasted_held: int = 0
    """The part of bytes_wasted whose tensor was still held by someone else at backward (the
    schedule, the caller's batch, a model's cache); the rest were writes under way when
    backward wanted them. Such a storage passes through from then on (cache/held.py)."""
    bytes_wasted_by_origin: Dict[str, int] = field(default_factory=dict)
    """bytes_wasted by how and where, largest first: keys "<how>: <origin>", how one of
    "released unread" (written, then released without a read: its graph was dropped, or the
    step ended without its backward), "forwarded" (backward took it from memory while its write
    was under way), "held" (as bytes_wasted_held) and "modified in place" (changed while it was
    written: it cannot come back); origin the saving layer, dtype and shape
    (``layer 3 float32[64, 2, 128]``) and, with ``debug_save_sites``, the code that saved it."""
    tensors_held_by_schedule: int = 0
    """Saved tensors left to autograd because something else holds them until backward anyway
    (a pipeline stage's received input, or a storage found alive at an earlier backward):
    writing them would free nothing."""
    writes_taken_back: int = 0
    """Writes cancelled before any IO thread started them, because backward wanted the tensor
    first: forwarded from memory with nothing written (counted in tensors_forwarded too)."""
    tensors_from_staging: int = 0
    """GPU, drive engines: tensors backward wanted while their drive write was under way, copied
    back to the device from the write's pinned host staging (no read from the drive; counted
    in tensors_forwarded too)."""
    bytes_from_staging: int = 0
    """The bytes of tensors_from_staging (not in bytes_read, which counts the engine's reads)."""
    offload_submit_s: float = 0.0
    """Training-thread seconds spent handing writes to the engine (the planner's CPU cost of
    offloading); measured only under a budget or the adaptive policy, else 0."""
    budget_bytes: Optional[int] = None
    """activation_budget_bytes in bytes (None: no budget); the budget_* counts below say what
    keeping peak_resident_bytes under it took."""
    budget_waits: int = 0
    """Times pack or a read waited for writes to complete to stay within the budget."""
    budget_wait_s: float = 0.0
    budget_deferred_written: int = 0
    """Last-layer records written early (instead of kept) to make room."""
    budget_readahead_cuts: int = 0
    """Times prefetch read less than its window because the budget had no room."""
    budget_forced_offloads: int = 0
    """Records the plan kept that were written instead, to leave room for a layer's backward."""
    budget_recomputes: int = 0
    """Layers run under recomputation (recompute_fallback) because their bytes would not fit."""
    budget_overruns: int = 0
    """Times nothing could make room and resident bytes went over the budget (warned)."""
    plan: Tuple[Tuple[int, str, str], ...] = ()
    """Adaptive: the plan in force, (micro-batch position, layer, decision) per row."""
    captured_kept: int = 0
    """Saved tensors left to autograd because a CUDA graph was being captured: a capture
    cannot hold the events and host-side IO of an offload, so they stay in (graph) memory."""
    passed_through_by_reason: Dict[str, int] = field(default_factory=dict)
    """tensors_passed_through by reason (PASS_REASONS; reasons with no tensor are left out)."""
    read_retries: int = 0
    """Failed reads started again (at most READ_RETRIES per tensor, cache/reads.py); a
    read whose retries all failed stops the step with an error naming layer and file."""
    step_end_wait_s: float = 0.0
    """Time end_step() blocked on IO still in flight (writes of tensors forwarded from memory,
    reads not consumed): part of step_time_s that io_wait_s leaves out; a drive too slow for
    the step shows here."""
    tier_bytes: Dict[str, int] = field(default_factory=dict)
    """Bytes per place: ``keep``, recorded and left in memory by the step (kept, fallbacks,
    writes taken back); and per tier of the engine (``host``, ``ssd``; the tiered engine has
    both, another engine its one), the bytes it wrote there."""
    tier_gbps: Dict[str, Dict[str, float]] = field(default_factory=dict)
    """Per tier of the engine, ``write`` and ``read`` GB/s over the time that tier was busy
    (write_gbps and read_gbps are both tiers together)."""
    not_offloaded_why: str = ""
    """Non-empty when offload is on and this step (after the first) offloaded nothing, or a
    layer whose decision is offload recorded nothing: the dominant reason and its fix
    (cache/silence.py). Logged as a warning once per job."""

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layers"] = [dataclasses.asdict(r) for r in self.layers]
        return d

    def summary(self) -> str:
        """One line: what was written and read, how fast, what waited, what stayed in memory;
        the counts of what is warned about once per job and may recur every step (fallbacks:
        writes that did not reach the drive; reads retried; budget overruns) whenever there
        were any, so the warning is not repeated and the step still says how often."""
        fell = "".join(f", {n} {one if n == 1 else many}{why}" for n, one, many, why in (
            (self.fallbacks, "FALLBACK", "FALLBACKS", " (writes that failed and stayed in memory)"),
            (self.read_retries, "READ RETRY", "READ RETRIES", ""),
            (self.budget_overruns, "BUDGET OVERRUN", "BUDGET OVERRUNS", "")) if n)
        return (f"offloaded {self.bytes_offloaded / 1e6:.1f} MB in {self.tensors_offloaded} tensors "
                f"(read {self.bytes_read / 1e6:.1f} MB, dedup {self.bytes_deduplicated / 1e6:.1f} MB, "
                f"forwarded {self.tensors_forwarded}, wasted {self.bytes_wasted / 1e6:.1f} MB, "
                f"held {self.tensors_held_by_schedule}), write {self.write_gbps:.2f} GB/s, "
                f"read {self.read_gbps:.2f} GB/s, io wait {self.io_wait_s * 1e3:.1f} ms, "
                f"peak resident {self.peak_resident_bytes / 1e6:.1f} MB{self._tier_summary()}{fell}"
                f"{self._why_summary()}")

    def _tier_summary(self) -> str:
        """Bytes per place: kept in memory, then each tier of the engine with its bandwidth."""
        if not self.tier_bytes:
            return ""
        parts = []
        for tier, nbytes in self.tier_bytes.items():
            bw = self.tier_gbps.get(tier)
            rate = f" (write {bw['write']:.2f}, read {bw['read']:.2f} GB/s)" if bw and nbytes else ""
            parts.append(f"{tier} {nbytes / 1e6:.1f} MB{rate}")
        return "; tiers: " + ", ".join(parts)

    def _why_summary(self) -> str:
        """Pass-through by reason, and why nothing was offloaded when that happened."""
        passed = ", ".join(f"{r} {n}" for r, n in sorted(self.passed_through_by_reason.items()))
        text = f"; passed through: {passed}" if passed else ""
        return text + (f"; NOT OFFLOADING: {self.not_offloaded_why}" if self.not_offloaded_why else "")


@dataclass
class _LayerAcc:
    bytes: int = 0
    bytes_offloaded: int = 0
    tensors: int = 0
    decision: str = "offload"
    io_wait_s: float = 0.0
    forward_s: float = 0.0
    recompute_s: float = 0.0
    recomputes: int = 0
    late_writes: int = 0
    backward_s: float = 0.0

    def recomputed(self, seconds: float) -> None:
        self.recompute_s += seconds
        self.recomputes += 1


# A record transition's effect (cache/record.py) -> the tensor count and the byte count it adds
# to, and for a written byte wasted, how (StepStats.bytes_wasted_by_origin).
_EFFECTS: Dict[str, Tuple[Optional[str], Optional[str], Optional[str]]] = {
    "offloaded": ("tensors_offloaded", "bytes_offloaded", None),
    "forwarded": ("tensors_forwarded", None, None),
    "taken_back": ("writes_taken_back", None, None),
    "held": (None, "bytes_wasted_held", "held"),
    "written_forwarded": (None, None, "forwarded"),
    "released_unread": (None, None, "released unread"),
    "written_modified": (None, None, "modified in place"),
    "read": (None, "bytes_read", None),
    "from_staging": ("tensors_from_staging", "bytes_from_staging", None),
    "kept": ("tensors_kept", None, None),
    "fallback": ("fallbacks", None, None),
    "read_retried": ("read_retries", None, None),
}


@dataclass
class StepCounters:
    """Mutable counters of the running step; the offloader updates them under its lock."""

    bytes_offloaded: int = 0
    bytes_read: int = 0
    bytes_deduplicated: int = 0
    tensors_offloaded: int = 0
    tensors_passed_through: int = 0
    tensors_kept: int = 0
    tensors_forwarded: int = 0
    writes_taken_back: int = 0
    bytes_wasted_held: int = 0
    tensors_from_staging: int = 0
    bytes_from_staging: int = 0
    io_wait_s: float = 0.0
    step_end_wait_s: float = 0.0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    fallbacks: int = 0
    read_retries: int = 0
    layers: Dict[Hashable, _LayerAcc] = field(default_factory=dict)
    passed: Dict[Tuple[Hashable, str], int] = field(default_factory=dict)
    """Pass-through count by (layer scope, reason) (silence.py names a layer's reason)."""
    pass_detail: Dict[str, str] = field(default_factory=dict)
    """The first detail seen per reason (e.g. the device the tensors were on)."""
    wasted: Dict[Tuple[str, str], int] = field(default_factory=dict)
    """Written bytes wasted, by (how, origin): StepStats.bytes_wasted_by_origin."""
    timeline: Optional[list] = None
    """When a list: (perf_counter time, resident bytes) at every change (plots)."""
    backward_at: Dict[Hashable, Tuple[Hashable, float, float]] = field(default_factory=dict)
    """Per micro-batch, the layer its backward entered last: (layer, when, io_wait_s then)."""
    backward_cpu_at: Dict[Hashable, Tuple[int, float]] = field(default_factory=dict)
    """Per micro-batch, (thread, its CPU time) when its backward entered the layer it is in."""

    def layer(self, key: Hashable, decision: str) -> _LayerAcc:
        acc = self.layers.get(key)
        if acc is None:
            acc = self.layers[key] = _LayerAcc(decision=decision)
        return acc

    def saved(self, key: Hashable, decision: str, nbytes: int) -> None:
        """A new record of ``nbytes`` in layer ``key`` (the pack hook): resident now, and one
        more tensor of its layer."""
        self.add_resident(nbytes)
        acc = self.layers.get(key)
        if acc is None:
            acc = self.layers[key] = _LayerAcc(decision=decision)
        acc.bytes += nbytes
        acc.tensors += 1

    def count(self, effect: str, nbytes: int, layer: Hashable, decision: str,
              record: Any = None) -> None:
        """What one record transition did (an effect of cache/record.py's TRANSITIONS).
        ``record``: the record (its ``origin()`` names where wasted bytes came from)."""
        tensors, byte_field, wasted = _EFFECTS[effect]
        if tensors:
            setattr(self, tensors, getattr(self, tensors) + 1)
        if byte_field:
            setattr(self, byte_field, getattr(self, byte_field) + nbytes)
        if effect == "offloaded":
            self.layer(layer, decision).bytes_offloaded += nbytes
        elif wasted is not None:  # written for nothing: off the pack path (a rare transition)
            key = (wasted, record.origin() if record is not None else f"layer {layer}")
            self.wasted[key] = self.wasted.get(key, 0) + nbytes

    def backward_entered(self, micro_batch: Hashable, layer: Hashable, t: float,
                         cpu: Optional[Tuple[int, float]] = None) -> None:
        """Backward of ``micro_batch`` reached ``layer`` at ``t`` (perf_counter): the layer it
        was in before is done, its time less the IO waits since counted (LayerStats.backward_s).
        ``cpu``: (the thread, its CPU time, ``time.thread_time()``) now; where backward stayed on
        that thread, the layer's time is at most the CPU time it spent: a wait of any kind
        (a read, the throttle, a drain) sleeps and adds none, so a slow drive does not lengthen
        the compute the read-ahead window is sized by (plan/readahead.py)."""
        before = self.backward_at.get(micro_batch)
        cpu_before = self.backward_cpu_at.get(micro_batch)
        if before is not None:
            prev, t0, waited = before
            acc = self.layers.get(prev)
            if acc is not None:
                seconds = max(0.0, t - t0 - (self.io_wait_s - waited))
                if cpu is not None and cpu_before is not None and cpu[0] == cpu_before[0]:
                    seconds = min(seconds, max(0.0, cpu[1] - cpu_before[1]))
                acc.backward_s += seconds
        self.backward_at[micro_batch] = (layer, t, self.io_wait_s)
        if cpu is not None:
            self.backward_cpu_at[micro_batch] = cpu

    def pass_through(self, reason: str, layer: Hashable, detail: str = "") -> None:
        """A saved tensor left to autograd, for ``reason`` (PASS_REASONS)."""
        self.tensors_passed_through += 1
        key = (layer, reason)
        self.passed[key] = self.passed.get(key, 0) + 1
        if detail and reason not in self.pass_detail:
            self.pass_detail[reason] = detail

    def passed_by_reason(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for (_, reason), n in self.passed.items():
            out[reason] = out.get(reason, 0) + n
        return out

    def add_resident(self, delta: int) -> None:
        self.resident_bytes += delta
        if self.resident_bytes > self.peak_resident_bytes:
            self.peak_resident_bytes = self.resident_bytes
        if self.timeline is not None:
            self.timeline.append((time.perf_counter(), self.resident_bytes))

    def freeze(self, step: int, write: Tuple[int, float], read: Tuple[int, float], bytes_on_disk: int,
               step_time_s: float, iteration_time_s: float = 0.0,
               tiers: Optional[Dict[str, Tuple[Tuple[int, float], Tuple[int, float]]]] = None) -> StepStats:
        """The step's StepStats; ``tiers``: per tier of the engine, its (write, read) traffic
        as ``(bytes, busy seconds)`` (telemetry/tiers.py)."""
        rows = tuple(LayerStats(layer=str(k), bytes=a.bytes, bytes_offloaded=a.bytes_offloaded,
                                tensors=a.tensors, decision=a.decision, io_wait_s=a.io_wait_s,
                                forward_s=a.forward_s, recompute_s=a.recompute_s,
                                recomputes=a.recomputes, late_writes=a.late_writes, backward_s=a.backward_s)
                     for k, a in sorted(self.layers.items(), key=lambda kv: _sort_key(kv[0])))
        by_reason = self.passed_by_reason()
        return StepStats(
            step=step, bytes_offloaded=self.bytes_offloaded, bytes_read=self.bytes_read,
            bytes_deduplicated=self.bytes_deduplicated, tensors_offloaded=self.tensors_offloaded,
            tensors_passed_through=self.tensors_passed_through, tensors_kept=self.tensors_kept,
            tensors_forwarded=self.tensors_forwarded,
            bytes_wasted=max(0, self.bytes_offloaded - self.bytes_read),
            tensors_held_by_schedule=by_reason.get("held_by_schedule", 0),
            writes_taken_back=self.writes_taken_back, bytes_wasted_held=self.bytes_wasted_held,
            tensors_from_staging=self.tensors_from_staging, bytes_from_staging=self.bytes_from_staging,
            io_wait_s=self.io_wait_s, step_end_wait_s=self.step_end_wait_s,
            peak_resident_bytes=self.peak_resident_bytes, write_gbps=_gbps(*write), read_gbps=_gbps(*read),
            bytes_on_disk=bytes_on_disk, fallbacks=self.fallbacks, step_time_s=step_time_s, layers=rows,
            iteration_time_s=iteration_time_s, captured_kept=by_reason.get("cuda_graph_capture", 0),
            passed_through_by_reason=by_reason, read_retries=self.read_retries,
            tier_bytes=self._tier_bytes(tiers) if tiers is not None else {},
            tier_gbps={t: {"write": _gbps(*w), "read": _gbps(*r)} for t, (w, r) in (tiers or {}).items()},
            bytes_wasted_by_origin={f"{how}: {origin}": n for (how, origin), n in
                                    sorted(self.wasted.items(), key=lambda kv: (-kv[1], kv[0]))})

    def _tier_bytes(self, tiers: Dict[str, Tuple[Tuple[int, float], Tuple[int, float]]]) -> Dict[str, int]:
        recorded = sum(a.bytes for a in self.layers.values())
        out = {"keep": max(0, recorded - self.bytes_offloaded)}
        out.update((t, w[0]) for t, (w, _) in tiers.items())
        return out


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _sort_key(k: Hashable):
    """Layers sort in forward order: ints, then tuples (e.g. (vp_stage, layer)), then the rest."""
    if isinstance(k, int):
        return (0, k, ())
    if isinstance(k, tuple):
        return (1, 0, tuple(str(x) for x in k) if not all(isinstance(x, int) for x in k) else k)
    return (2, 0, (str(k),))


def run_header(job: str, rank: int, started: float, config: dict) -> dict:
    """The line that opens one run's steps in a stats file: a file appended to across runs
    (a restarted job) starts at step 0 again, and readers split runs at these lines. They have
    ``run`` and no ``step``: ``job``, ``rank``, ``started`` (UTC, ISO 8601), ``config_digest``
    (the first 16 hex digits of the SHA-256 of the settings as sorted JSON) and ``policy``."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    when = datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds")
    return {"run": {"job": job, "rank": rank, "started": when, "config_digest": digest,
                    "policy": config.get("policy")}}


def append_line(path: Union[str, AppendFile], record: dict) -> None:
    """Append one JSON object as a line (the file and its folder created if missing): to an
    :class:`AppendFile` a job holds open, or, given a path, through one opened for this line."""
    out = path if isinstance(path, AppendFile) else AppendFile(path)
    try:
        out.write(json.dumps(record) + "\n")
    finally:
        if out is not path:
            out.close()


def append_jsonl(path: Union[str, AppendFile], stats: StepStats, extra: Optional[dict] = None) -> None:
    """Append one step to a JSONL file (created if missing): the StepStats fields, ``iteration``
    (step + 1) and ``extra`` (the offloader adds its ``policy``, so that several offloaders,
    e.g. the demo's keep and offload, can share one file)."""
    record = stats.as_dict()
    record["iteration"] = stats.step + 1
    if extra:
        record.update(extra)
    append_line(path, record)
