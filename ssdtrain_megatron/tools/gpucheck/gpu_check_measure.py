"""The measure step of `make gpu-check` (gpu_check.py) and what `make gpu-perf`
(gpu_perf.py) measures with it: peak memory, step time, the training thread's stall,
tokens/s, each point's bound and its excess split by cause, on the GPU, in its own process.

A point is one strategy (keep, offload with an engine, adaptive, full recompute, or torch's
``save_on_cpu``: gpu_check_runner.py) at one micro-batch size: a warm-up step (adaptive:
until its measured selection settled, plan/explore.py), then --steps timed steps (at least 5
count for a target), the median and the spread kept, the last recorded as a timeline
(ssdtrain_megatron/telemetry/timeline.py) and written as a Chrome trace. Peak memory is each
step's peak over its forward and backward (read as the optimizer starts) against memory at the
step's start (after ``zero_grad``; the cache emptied after the warm-up), on a model with
Megatron's memory layout (``GpuGPT(grad_buffers=True)``: gradients allocated once, a fused
Adam): the activations' part, which offload moves, not the weights, gradients and optimizer
state, nor the optimizer's working memory.

The bounds are measured in the same run (gpu_check_bounds.py): after keep, the sizes
of the records; after offload (memory), the link on registered memory at those sizes; after
offload (posix), the drive in the step's pattern. :meth:`Measure.judge` then gives every point
its bound, the stall beyond the IO deficit, and the excess split by cause
(ssdtrain_megatron/telemetry/breakdown.py).

The measure step of `make gpu-check`: keep, offload (memory, posix) and full recompute at
micro-batch K (--micro-batch); then a budget that fits keep at K and not at K+1 (memory at
keep's step start + (K + 0.5) x one sample's activations), and at K+1 inside it: keep (expected
out of memory), full recompute and adaptive. A point that needs more drive space or host memory
than the box has (its pinned pools counted as pinning really locks them, the staging pool
included), or comes when the step's time is nearly up, is not run and says why; results are
saved after every point, so a step stopped by its time limit keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import statistics
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch

from .gpu_check_bounds import judge_points, measure_drive, measure_link, record_sizes
from .gpu_check_common import CudaBox, GpuGPT, deadline_left
from .gpu_check_plan import (ADAPTIVE_EXPLORE_STEPS, ADAPTIVE_SETTLE_CAP, ADAPTIVE_TRIAL_STEPS, MEASURE_INFLIGHT,
                            OVERFLOW_STAGING, measure_estimate, memory_pool_bytes, reserves)
from .gpu_check_runner import SAVE_ON_CPU, TRACE_MAX_BYTES, Runner, record_step
from .gpu_drive import probe as probe_drive
from .gpu_drive import raw_rates
from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io.pinned import pinned_cost
from ssdtrain_megatron.telemetry.timeline import Timeline
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime


# min_tensor_bytes of every point, set rather than left to the device default (1 MiB on CUDA):
# 256 KiB, the default when this step was written and still the default off CUDA
# (config.MIN_TENSOR_BYTES); the bounds count the records of at least this size (record_sizes).
MIN_TENSOR_BYTES = 256 * 1024
LINK_HOLD_CYCLES = 4_000_000  # ~2 ms on the compute stream while the link measurement's copies are issued
# What a point (or a rate) must have left to start: its own estimate at the plan's rates
# (Measure.reserve) and this, for saving what it measured and writing its trace; inside a
# point, two of its slowest steps and this. A point the plan has no estimate for keeps the
# reserve every point had before it scaled with its estimate.
RESERVE_SLACK_S = 2.0
PACE_RANGE = (0.1, 4.0)
"""The pace (measured over estimated seconds of what ran) a reserve is scaled by, at least and
at most: a box far faster than the plan's rates still keeps a tenth of each estimate."""
UNPLANNED_RESERVE_S = 20.0


def _trace() -> str:
    """The exception being handled, as the traceback Python prints (its last 4,000 characters)."""
    return traceback.format_exc()[-4000:]


class StallProbe:
    """Seconds the training thread spends waiting on the offloader's IO: every such wait
    (back-pressure in pack, a read in unpack, a budget wait, the end-of-step wait for writes and
    reads) goes through ``Progress.next_event``, which blocks on the IO threads' event queue;
    StepStats.io_wait_s leaves the end-of-step wait out. Where that method is gone (the data
    path was reshaped), ``source`` says so and the stats are used instead."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real = None
        self.source = "Progress.next_event on the training thread"

    def __enter__(self) -> "StallProbe":
        from ssdtrain_megatron.cache.progress import Progress

        real = getattr(Progress, "next_event", None)
        if real is None:
            self.source = "StepStats io_wait_s + budget_wait_s (Progress.next_event not found)"
            return self
        probe = self

        # Only the training side calls it (the IO threads put events, never take them): the
        # main thread in forward and at the end of the step, autograd's device thread in
        # backward on CUDA, while the main thread waits in backward() -- never both at once.
        def timed_next_event(obj, deadline, *args, **kw):
            t0 = time.perf_counter()
            try:
                return real(obj, deadline, *args, **kw)
            finally:
                probe.seconds += time.perf_counter() - t0

        self._real = real
        Progress.next_event = timed_next_event
        return self

    def __exit__(self, *exc) -> None:
        from ssdtrain_megatron.cache.progress import Progress

        if self._real is not None:
            Progress.next_event = self._real
            self._real = None

    @property
    def works(self) -> bool:
        return self._real is not None


class Measure:
    """One model, measured point by point under different strategies and budgets."""

    def __init__(self, args, save: Callable[[dict], None], model: GpuGPT, device: torch.device,
                 box: CudaBox, trace_dir: Optional[str] = None, until: Optional[float] = None,
                 estimates: Optional[Dict[str, float]] = None) -> None:
        """``until``: a deadline of its own (``time.time()``), earlier than the step's: the
        measurements stop in time for what the step does after them. ``estimates``: the
        plan's seconds for each point by name and for the "link" and "drive" rates
        (gpu_check_plan.points_estimate): what each must have left to start."""
        self.args, self.save, self.model, self.dev, self.box = args, save, model, device, box
        self.trace_dir, self.until = trace_dir, until
        # What the posix points' bytes go to (gpu_drive.py): a drive with O_DIRECT, or the rows say why not.
        self.result: Dict[str, object] = {"points": [], "drive": probe_drive(args.scratch)}
        self.total = box.total_memory(device)
        self.host_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.registers = box.registration_works()
        self.base_cfg = OffloadConfig(dirs=[args.scratch], engine="posix", min_tensor_bytes=MIN_TENSOR_BYTES)
        self.per_sample: Optional[float] = None  # one sample's activations, once keep has run
        self.probe = StallProbe()
        self.timelines: Dict[str, Timeline] = {}  # point -> its last timed step
        self.stats: Dict[str, object] = {}  # point -> its last StepStats (the model's prediction reads them)
        self.rates: Dict[str, Optional[dict]] = {"link": None, "drive": None}
        self.sizes: List[int] = []
        self.estimates: Dict[str, float] = dict(estimates or {})
        self.ran: List[tuple] = []  # (seconds measured, seconds estimated) of each planned point and rate run

    def left(self) -> float:
        """Seconds until this measurement's deadline (the step's, or ``until`` if earlier)."""
        left = deadline_left()
        return left if self.until is None else min(left, self.until - time.time())

    def reserve(self, name: str) -> float:
        """Seconds ``name`` (a point or a rate) must have left to start: its own estimate at the
        plan's rates, and a little for saving what it measured; UNPLANNED_RESERVE_S for a point
        the plan does not know. Scaled to each point, not fixed: a fixed 20 s left the short
        points at the end of a share (save_on_cpu, recompute, adaptive) unrun."""
        est = self.estimates.get(name)
        return UNPLANNED_RESERVE_S if est is None else RESERVE_SLACK_S + est * self.pace()

    def pace(self) -> float:
        """Measured over estimated seconds of the planned points and rates run so far (1 before
        any), within PACE_RANGE: each reserve is its estimate at this pace, so a box faster than
        the plan's rates starts the long points at the end of a share that the estimate alone
        would cut, and a slower one stops in time."""
        measured, estimated = sum(m for m, _ in self.ran), sum(e for _, e in self.ran)
        return 1.0 if estimated <= 0 else min(max(measured / estimated, PACE_RANGE[0]), PACE_RANGE[1])

    def _ran(self, name: str, seconds: float) -> None:
        if name in self.estimates:
            self.ran.append((seconds, self.estimates[name]))
            self.result["pace"] = round(self.pace(), 3)

    def pinned(self, policy: str, cfg_kw: dict, mb: int = 1) -> int:
        """Host memory the point locks: its offloader's staging pool and its engine's pool, at
        what pinning really locks here (io/pinned.py); save_on_cpu: torch's pinned allocator
        (powers of two) for a copy of every saved tensor, the weights included, up to twice it."""
        if policy == "keep":
            return 0
        if policy == SAVE_ON_CPU:  # every saved tensor: the activations and the weights
            return int(2 * ((self.per_sample or 0) * mb + sum(p.nbytes for p in self.model.params)))
        cfg = self.base_cfg.replace(**cfg_kw)
        pool = cfg.host_memory_bytes if cfg.engine in ("memory", "tiered") else 0
        return pinned_cost(cfg.staging_bytes(), self.registers) + pinned_cost(pool, self.registers)

    def _skip(self, mb: int, policy: str, engine: str, cfg_kw: dict, name: str = "") -> Optional[str]:
        need = self.per_sample * mb * 1.1 if self.per_sample else 0
        free = shutil.disk_usage(self.args.scratch).free
        left, reserve = self.left(), self.reserve(name)
        if left < reserve:
            return f"not run: out of time ({left:.0f}s left, its estimate needs {reserve:.0f}s)"
        if policy not in ("keep", SAVE_ON_CPU) and engine == "posix" and need > free:
            return f"not run (disk): needs about {need / 1e9:.0f} GB on the drive, {free / 1e9:.0f} GB free"
        pinned = self.pinned(policy, dict(cfg_kw, engine=engine), mb)
        if pinned > 0.75 * self.host_ram:
            return (f"not run (host memory): {pinned / 1e9:.0f} GB of pinned pools (staging included"
                    f"{'' if self.registers else '; torch pinned allocator: powers of two'}), "
                    f"{self.host_ram / 1e9:.0f} GB of RAM")
        return None

    def point(self, name: str, mb: int, policy: str, engine: str = "posix", recompute: bool = False,
              budget: Optional[int] = None, warmup: int = 1, **cfg_kw) -> dict:
        """One strategy measured (module docstring); policy "save_on_cpu" runs torch's hooks
        instead of an offloader."""
        p: Dict[str, object] = {"name": f"{name}@{mb}", "micro_batch": mb, "policy": policy,
                                "engine": engine if policy not in ("keep", SAVE_ON_CPU) else None,
                                "budget_bytes": budget}
        why = self._skip(mb, policy, engine, cfg_kw, str(p["name"]))
        if why:
            p.update(ok=False, error=why)
            return self._done(p)
        began = time.perf_counter()
        box = self.box
        off = streams = None
        stopped: Optional[BaseException] = None  # a signal, or the like: the point is saved, then it goes on
        try:
            streams = box.streams() if policy not in ("keep", SAVE_ON_CPU) else None
            gc.collect()
            box.empty_cache()
            box.set_fraction(min(1.0, budget / self.total) if budget else 1.0, self.dev)
            self.model.set_micro_batch(mb)
            self.model.set_recompute(recompute)
            t0 = time.perf_counter()
            if policy != SAVE_ON_CPU:
                cfg = self.base_cfg.replace(policy=policy, engine=engine, job=f"gc-{name}-{mb}", **cfg_kw)
                off = ActivationOffloader(cfg, device=self.dev, streams=streams)
            p.update(start_s=time.perf_counter() - t0, pinned_bytes=self.pinned(policy, dict(cfg_kw, engine=engine), mb))
            runner = Runner(self.model, off)
            p.update(self._warm_up(runner, warmup, str(p["name"])))
            p.update(self._timed(runner, str(p["name"]), mb, streams))
        except box.oom as exc:
            p.update(ok=False, oom=True, error=str(exc).splitlines()[0][:300], traceback=_trace())
        except BaseException as exc:  # noqa: BLE001 - one point failing does not end the step
            p.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500], traceback=_trace())
            if not isinstance(exc, Exception):
                stopped = exc
        cleanup = self._clean_up(off)
        if cleanup is not None:
            # Cleaning up raised too: the device is gone (a sticky error makes every call
            # raise). The point is saved with both, and the cleanup's error ends the shape.
            p.update(ok=False, cleanup_error=f"{type(cleanup).__name__}: {cleanup}"[:500],
                     cleanup_traceback="".join(traceback.format_exception(type(cleanup), cleanup,
                                                                          cleanup.__traceback__))[-4000:])
        p["seconds"] = round(time.perf_counter() - began, 2)
        self._ran(str(p["name"]), p["seconds"])
        self._done(p)
        if stopped is not None:
            raise stopped
        if cleanup is not None:
            raise cleanup
        return p

    def _clean_up(self, off) -> Optional[BaseException]:
        """What a point leaves behind, undone: its offloader closed, the gradients freed,
        recompute off, the memory fraction back. Every part is tried; the first error is
        returned, not raised, so the point that caused it is saved first."""
        first: Optional[BaseException] = None
        parts = ([off.close] if off is not None else []) + [
            lambda: self.model.optimizer.zero_grad(set_to_none=True),
            lambda: self.model.set_recompute(False),
            lambda: self.box.set_fraction(1.0, self.dev)]
        for part in parts:
            try:
                part()
            except Exception as exc:  # noqa: BLE001 - returned to the caller
                first = first or exc
        return first

    def _done(self, p: dict) -> dict:
        """A point, finished or failed, into the result, saved at once."""
        self.result["points"].append(p)
        self.save(dict(self.result, status="running"))
        print(f"measure: {dict((k, v) for k, v in p.items() if not k.endswith('traceback'))}", flush=True)
        return p

    def _warm_up(self, runner: Runner, steps: int, name: str = "") -> dict:
        """``steps`` steps; adaptive (a planner with measured selection) until it settled, at
        most ADAPTIVE_SETTLE_CAP steps: its timed steps then measure the plan it chose, not
        the ones it tried. Ends early when what is left would not hold the timed steps at the
        slowest warm-up step's pace."""
        off = runner.off
        selection = off.planner.selection if off is not None and off.planner is not None else None
        n, slowest, first = 0, 0.0, None
        while n < steps or (selection is not None and not selection.settled and n < ADAPTIVE_SETTLE_CAP):
            t0 = time.perf_counter()
            runner.step()
            dt = time.perf_counter() - t0
            first = dt if first is None else first
            slowest = max(slowest, dt)
            n += 1
            if self.left() < RESERVE_SLACK_S + (self.args.steps + 1) * slowest:
                break
        if selection is None:
            return {"warmup_steps": n, "first_step_s": first}
        return {"warmup_steps": n, "first_step_s": first, "settled": selection.settled, "settled_after": selection.settled_step}

    def _timed(self, runner: Runner, name: str, mb: int, streams) -> dict:
        """--steps steady-state steps (the last recorded as a timeline): time (median and spread),
        bytes, the training thread's time blocked on the offloader (StallProbe; the stats' own
        io_wait_s and budget_wait_s beside it), and memory: each step's peak over its forward
        and backward (read as the optimizer starts), against memory at the step's start (after
        zero_grad; the cache emptied once after the warm-up, so what the warm-up cached is not
        the baseline's), and the whole step's peak, optimizer included, beside it."""
        box, model = self.box, self.model
        gc.collect()
        box.empty_cache()
        times, written, read, stats_wait, submit = [], 0, 0, 0.0, 0.0
        starts, fb_peaks, whole_peaks = [], [], []
        probed = self.probe.seconds
        tl: Optional[Timeline] = None
        st = None
        hook = model.optimizer.register_step_pre_hook(lambda opt, a, kw: fb_peaks.append(box.peak(self.dev)))
        try:
            for i in range(self.args.steps):
                # The recorded step next when the one after it might not fit: two of the
                # slowest so far (this one and the recorded one) and the trace's writing.
                last = i == self.args.steps - 1 or self.left() < RESERVE_SLACK_S + 2 * max(times, default=0.0)
                model.optimizer.zero_grad(set_to_none=True)
                starts.append(box.now(self.dev))
                box.reset_peak(self.dev)
                if last:
                    dt, tl = record_step(box, runner, streams, self.dev, {"point": name})
                else:
                    dt = runner.step()
                whole_peaks.append(box.peak(self.dev))
                times.append(dt)
                st = runner.stats
                if st is not None:
                    written += st.bytes_offloaded
                    read += st.bytes_read
                    stats_wait += st.io_wait_s + st.budget_wait_s
                    submit += st.offload_submit_s
                if last:
                    break
        finally:
            hook.remove()
        start_alloc, start_reserved = min(a for a, _ in starts), starts[0][1]
        peak_alloc, peak_reserved = max(a for a, _ in fb_peaks), max(r for _, r in fb_peaks)
        n = len(times)
        stall = self.probe.seconds - probed if self.probe.works else stats_wait
        step_s = statistics.median(times)
        out = dict(ok=True, step_s=step_s, times=times, steps_timed=n, spread=(max(times) - min(times)) / step_s,
                   peak_bytes=max(a for a, _ in whole_peaks), peak_reserved=max(r for _, r in whole_peaks),
                   start_bytes=start_alloc, start_reserved=start_reserved,
                   activation_bytes=max(peak_alloc - start_alloc, 0),
                   activation_reserved=max(peak_reserved - start_reserved, 0),
                   stall_s=stall / n, stall_fraction=stall / sum(times), stall_source=self.probe.source,
                   stats_wait_s=stats_wait / n, submit_s=submit / n,
                   tokens_per_s=mb * model.spec.seq / step_s, bytes_written=written / n, bytes_read=read / n,
                   fallbacks=st.fallbacks if st is not None else 0)
        if st is not None:
            self.stats[name] = st
        if tl is not None:
            self.timelines[name] = tl
            out.update(timeline_step_s=times[-1], thread_cpu_s=tl.thread_cpu_s,
                       timeline_offloader_events=tl.meta.get("offloader_events", False))
            if self.trace_dir:
                out["trace"] = tl.write(os.path.join(self.trace_dir, f"{name.replace('@', '-mb')}.json"),
                                        TRACE_MAX_BYTES)
        off = runner.off
        if off is not None and off.planner is not None and off.planner.selection is not None:
            out["still_settled"] = off.planner.selection.settled  # no drift re-exploration while timed
        return out

    def offload_points(self, k: int) -> dict:
        """keep, then the records' sizes, offload (memory) and the link's rates, offload (posix)
        and the drive's rates, at micro-batch ``k``: the points every bound needs. Returns
        keep's point."""
        keep = self.point("keep", k, "keep")
        if not keep.get("ok"):
            return keep
        self.per_sample = max(keep["activation_bytes"], 1) / k
        self.sizes = record_sizes(self.model, MIN_TENSOR_BYTES)
        self.result["record_sizes"] = {"records": len(self.sizes), "bytes": sum(self.sizes),
                                       "largest": max(self.sizes, default=0)}
        self.point("offload-memory", k, "offload", "memory", **self.memory_settings(k))
        self._rate("link", lambda: measure_link(self.box.stream_ops(), self.dev, self.sizes,
                                                self.box.sleeper(LINK_HOLD_CYCLES)))
        posix = self.point("offload-posix", k, "offload", "posix", max_inflight_bytes=MEASURE_INFLIGHT)
        if posix.get("ok") and posix["bytes_written"]:
            cfg = self.base_cfg.replace(max_inflight_bytes=MEASURE_INFLIGHT, job=f"gc-drive-{k}")
            self._rate("drive", lambda: measure_drive(cfg, self.box.stream_ops(), self.sizes,
                                                      posix["bytes_written"], posix["bytes_read"]))
            # The drive's own rate, apart from the engine: what its bound is judged by (gpu_perf_targets.py).
            self._rate("drive_raw", lambda: raw_rates(self.args.scratch, int(posix["bytes_written"])))
        return keep

    def memory_settings(self, mb: int) -> dict:
        """The memory engine's pool for one micro-batch of ``mb`` samples, and a small staging
        pool for what does not fit."""
        return dict(host_memory_bytes=memory_pool_bytes(mb * (self.per_sample or 0)),
                    pinned_staging_bytes=OVERFLOW_STAGING)

    def _rate(self, kind: str, measure: Callable[[], dict]) -> None:
        left, reserve = self.left(), self.reserve(kind)
        if left < reserve:
            self.result[f"{kind}_rate_error"] = f"not measured: out of time ({left:.0f}s left, its estimate needs {reserve:.0f}s)"
            return
        began = time.perf_counter()
        try:
            self.rates[kind] = measure()
        except Exception as exc:  # noqa: BLE001 - the rows that need it say why
            self.result[f"{kind}_rate_error"] = f"{type(exc).__name__}: {exc}"[:500]
        self._ran(kind, time.perf_counter() - began)
        self.result["rates"] = self.rates
        self.save(dict(self.result, status="running"))

    def judge(self, k: int) -> None:
        """Every point at micro-batch ``k`` against its bound (gpu_check_bounds.judge_points)."""
        judge_points(self.result["points"], k, self.rates,
                     {name: tl.events for name, tl in self.timelines.items()})
        self.save(dict(self.result, status="running"))


def step_measure(args, save, box: CudaBox) -> dict:
    k = args.micro_batch
    spec = GPTSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                   micro_batch=k, num_microbatches=1)
    with MegatronRuntime() as rt, StallProbe() as probe:
        m = Measure(args, save, GpuGPT(spec, rt.device, grad_buffers=True), rt.device, box,
                    trace_dir=os.path.join(args.out, "traces", "measure"), estimates=reserves(measure_estimate(args)))
        m.probe = probe
        r = m.result
        r.update(spec=dataclasses.asdict(spec), micro_batch=k, registration_works=m.registers)
        save(dict(r, status="running"))
        # Keep first: its peak less memory at the step's start is K samples' activations.
        try:
            keep = m.offload_points(k)
            if not keep.get("ok"):
                return dict(r, status="fail", why=f"keep at micro-batch {k} failed: {keep.get('error')}")
            resident = keep["start_bytes"]
            activation = m.per_sample
            budget = int(resident + (k + 0.5) * activation)
            r.update(resident_bytes=resident, activation_bytes_per_sample=activation, budget_bytes=budget)
            m.point("recompute", k, "keep", recompute=True)
            m.point("keep", k + 1, "keep", budget=budget)
            m.point("recompute", k + 1, "keep", recompute=True, budget=budget)
            m.point("adaptive", k + 1, "adaptive", "posix", budget=budget, max_inflight_bytes=MEASURE_INFLIGHT,
                    memory_budget_bytes=int(0.5 * activation), recompute_fallback=True,
                    adaptive_trial_steps=ADAPTIVE_TRIAL_STEPS, adaptive_explore_steps=ADAPTIVE_EXPLORE_STEPS)
        finally:
            if m.per_sample is not None:  # keep ran: what was measured is judged, whatever ended the
                m.judge(k)  # points (host work: it runs after a CUDA error too)
    return dict(r, status="pass")
