"""The measure step of `make gpu-check` (scripts/gpu_check.py): peak memory, step time, the
training thread's stall and tokens/s per policy, on the GPU, in its own process.

Side by side at micro-batch K (--micro-batch): keep, offload (memory, posix), full recompute.
Then a budget that fits keep at K and not at K+1 (resident + (K + 0.5) x one sample's
activations, measured from keep), and at K+1 inside it: keep (expected out of memory), full
recompute, adaptive, offload. Adaptive is timed only once its measured selection settled (it
explores a few plans first, plan/explore.py); a point says whether it did. Every point records
its peak memory and what the same step holds with its activations freed (weights, gradients,
optimizer state: measured right after the step, the cache emptied), so the peak target judges
the activations' part, which offload moves, not the whole. A point that needs more drive space
or host memory than the box has (its pinned pools counted as pinning really locks them, the
staging pool included), or comes when the step's time is nearly up, is not run and says why;
results are saved after every point, so a step stopped by its time limit keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import statistics
import time
from typing import Callable, Dict, Optional

import torch

from gpu_check_common import CudaBox, GpuGPT, deadline_left
from gpu_check_plan import (ADAPTIVE_EXPLORE_STEPS, ADAPTIVE_SETTLE_CAP, ADAPTIVE_TRIAL_STEPS, MEASURE_INFLIGHT,
                            OVERFLOW_STAGING, memory_pool_bytes)
from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io.pinned import pinned_cost
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime, installed_step


MIN_TENSOR_BYTES = 256 * 1024  # the default: what a user's run offloads


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
        def timed_next_event(obj, deadline):
            t0 = time.perf_counter()
            try:
                return real(obj, deadline)
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


def _drive_bandwidth(out_dir: str) -> Optional[dict]:
    """The posix engine's bandwidth from the io-bench step's result, if it ran."""
    try:
        with open(os.path.join(out_dir, "steps", "io-bench.json")) as f:
            posix = json.load(f).get("posix")
    except (OSError, ValueError):
        return None
    return {"write": posix["write_gbps"] * 1e9, "read": posix["read_gbps"] * 1e9} if posix else None


class Measure:
    """One model, measured point by point under different policies and budgets."""

    def __init__(self, args, save: Callable[[dict], None], model: GpuGPT, device: torch.device,
                 box: CudaBox) -> None:
        self.args, self.save, self.model, self.dev, self.box = args, save, model, device, box
        self.result: Dict[str, object] = {"points": []}
        self.total = box.total_memory(device)
        self.host_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.registers = box.registration_works()
        self.base_cfg = OffloadConfig(dirs=[args.scratch], engine="posix", min_tensor_bytes=MIN_TENSOR_BYTES)
        self.per_sample: Optional[float] = None  # one sample's activations, once keep has run
        self.probe = StallProbe()

    def pinned(self, policy: str, cfg_kw: dict) -> int:
        """Host memory the point's offloader locks: its staging pool and its engine's pool, at
        what pinning really locks here (io/pinned.py)."""
        if policy == "keep":
            return 0
        cfg = self.base_cfg.replace(**cfg_kw)
        pool = cfg.host_memory_bytes if cfg.engine in ("memory", "tiered") else 0
        return pinned_cost(cfg.staging_bytes(), self.registers) + pinned_cost(pool, self.registers)

    def _skip(self, mb: int, policy: str, engine: str, cfg_kw: dict) -> Optional[str]:
        need = self.per_sample * mb * 1.1 if self.per_sample else 0
        free = shutil.disk_usage(self.args.scratch).free
        if deadline_left() < 20:
            return "not run: out of time"
        if policy != "keep" and engine == "posix" and need > free:
            return f"not run (disk): needs about {need / 1e9:.0f} GB on the drive, {free / 1e9:.0f} GB free"
        pinned = self.pinned(policy, dict(cfg_kw, engine=engine))
        if pinned > 0.75 * self.host_ram:
            return (f"not run (host memory): {pinned / 1e9:.0f} GB of pinned pools (staging included"
                    f"{'' if self.registers else '; torch pinned allocator: powers of two'}), "
                    f"{self.host_ram / 1e9:.0f} GB of RAM")
        return None

    def point(self, name: str, mb: int, policy: str, engine: str = "posix", recompute: bool = False,
              budget: Optional[int] = None, warmup: int = 1, **cfg_kw) -> dict:
        p: Dict[str, object] = {"name": f"{name}@{mb}", "micro_batch": mb, "policy": policy, "engine": engine,
                                "budget_bytes": budget}
        why = self._skip(mb, policy, engine, cfg_kw)
        if why:
            p.update(ok=False, error=why)
        else:
            box = self.box
            gc.collect()
            box.empty_cache()
            box.set_fraction(min(1.0, budget / self.total) if budget else 1.0, self.dev)
            self.model.set_micro_batch(mb)
            self.model.set_recompute(recompute)
            off = None
            try:
                t0 = time.perf_counter()
                off = ActivationOffloader(self.base_cfg.replace(policy=policy, engine=engine, job=f"gc-{name}-{mb}",
                                                                **cfg_kw), device=self.dev,
                                          streams=box.streams() if policy != "keep" else None)
                p.update(start_s=time.perf_counter() - t0, pinned_bytes=self.pinned(policy, dict(cfg_kw, engine=engine)))
                p.update(self._warm_up(off, warmup))
                p.update(self._timed(off, mb))
            except box.oom as exc:
                p.update(ok=False, oom=True, error=str(exc).splitlines()[0][:300])
            except Exception as exc:  # noqa: BLE001 - one point failing does not end the step
                p.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
            finally:
                if off is not None:
                    off.close()
                self.model.optimizer.zero_grad(set_to_none=True)
                self.model.set_recompute(False)
                box.set_fraction(1.0, self.dev)
        self.result["points"].append(p)
        self.save(dict(self.result, status="running"))
        print(f"measure: {p}", flush=True)
        return p

    def _warm_up(self, off: ActivationOffloader, steps: int) -> dict:
        """``steps`` steps; adaptive (a planner with measured selection) until it settled, at
        most ADAPTIVE_SETTLE_CAP steps: its timed steps then measure the plan it chose, not
        the ones it tried."""
        selection = off.planner.selection if off.planner is not None else None
        n = 0
        while n < steps or (selection is not None and not selection.settled and n < ADAPTIVE_SETTLE_CAP):
            installed_step(self.model, off)
            n += 1
            if deadline_left() < 20:
                break
        if selection is None:
            return {"warmup_steps": n}
        return {"warmup_steps": n, "settled": selection.settled, "settled_after": selection.settled_step}

    def _timed(self, off: ActivationOffloader, mb: int) -> dict:
        """--steps steady-state steps: peak memory (reserved and allocated), what the step holds
        with its activations freed, time, bytes, and the training thread's time blocked on the
        offloader (StallProbe; the stats' own io_wait_s and budget_wait_s beside it)."""
        box = self.box
        box.reset_peak(self.dev)
        times, written, read, stats_wait, submit = [], 0, 0, 0.0, 0.0
        probed = self.probe.seconds
        for _ in range(self.args.steps):
            _, dt = installed_step(self.model, off)
            st = off.last_step_stats
            times.append(dt)
            written += st.bytes_offloaded
            read += st.bytes_read
            stats_wait += st.io_wait_s + st.budget_wait_s
            submit += st.offload_submit_s
            if deadline_left() < 10:
                break
        peak_alloc, peak_reserved = box.peak(self.dev)
        gc.collect()
        box.empty_cache()  # what stays: weights, gradients, optimizer state, in their segments
        held_alloc, held_reserved = box.now(self.dev)
        n = len(times)
        stall = self.probe.seconds - probed if self.probe.works else stats_wait
        step_s = statistics.median(times)
        out = dict(ok=True, step_s=step_s, times=times, peak_bytes=peak_alloc, peak_reserved=peak_reserved,
                   held_bytes=held_alloc, held_reserved=held_reserved,
                   activation_bytes=max(peak_alloc - held_alloc, 0),
                   activation_reserved=max(peak_reserved - held_reserved, 0),
                   stall_s=stall / n, stall_fraction=stall / sum(times), stall_source=self.probe.source,
                   stats_wait_s=stats_wait / n, submit_s=submit / n, resident_after_step=held_alloc,
                   tokens_per_s=mb * self.model.spec.seq / step_s, bytes_written=written / n, bytes_read=read / n,
                   fallbacks=st.fallbacks)
        if off.planner is not None and off.planner.selection is not None:
            out["still_settled"] = off.planner.selection.settled  # no drift re-exploration while timed
        return out


def step_measure(args, save, box: CudaBox) -> dict:
    k = args.micro_batch
    spec = GPTSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                   micro_batch=k, num_microbatches=1)
    with MegatronRuntime() as rt, StallProbe() as probe:
        m = Measure(args, save, GpuGPT(spec, rt.device), rt.device, box)
        m.probe = probe
        r = m.result
        drive = _drive_bandwidth(args.out)
        r.update(spec=dataclasses.asdict(spec), micro_batch=k, registration_works=m.registers,
                 bandwidth={"memory": box.pinned_bandwidth(rt.device), **({"posix": drive} if drive else {})})
        save(dict(r, status="running"))
        # Keep first: its peak minus what the step holds with its activations freed (weights,
        # gradients, optimizer state) is K samples' activations.
        keep = m.point("keep", k, "keep")
        if not keep.get("ok"):
            return dict(r, status="fail", why=f"keep at micro-batch {k} failed: {keep.get('error')}")
        resident = keep["held_bytes"]
        activation = max(keep["activation_bytes"], 1) / k
        m.per_sample = activation
        budget = int(resident + (k + 0.5) * activation)
        r.update(resident_bytes=resident, activation_bytes_per_sample=activation, budget_bytes=budget)
        memory = lambda mb: dict(host_memory_bytes=memory_pool_bytes(mb * activation),  # noqa: E731
                                 pinned_staging_bytes=OVERFLOW_STAGING)
        m.point("offload-memory", k, "offload", "memory", **memory(k))
        m.point("offload-posix", k, "offload", "posix", max_inflight_bytes=MEASURE_INFLIGHT)
        m.point("recompute", k, "keep", recompute=True)
        m.point("keep", k + 1, "keep", budget=budget)
        m.point("recompute", k + 1, "keep", recompute=True, budget=budget)
        m.point("adaptive", k + 1, "adaptive", "posix", budget=budget, max_inflight_bytes=MEASURE_INFLIGHT,
                memory_budget_bytes=int(0.5 * activation), recompute_fallback=True,
                adaptive_trial_steps=ADAPTIVE_TRIAL_STEPS, adaptive_explore_steps=ADAPTIVE_EXPLORE_STEPS)
        m.point("offload-memory", k + 1, "offload", "memory", budget=budget, **memory(k + 1))
        m.point("offload-posix", k + 1, "offload", "posix", budget=budget, max_inflight_bytes=MEASURE_INFLIGHT)
    return dict(r, status="pass")
