"""The measure step of `make gpu-check` (scripts/gpu_check.py): peak memory, step time, the
training thread's stall and tokens/s per policy, on the GPU, in its own process.

Side by side at micro-batch K (--micro-batch): keep, offload (memory, posix), full recompute.
Then a budget that fits keep at K and not at K+1 (resident + (K + 0.5) x one sample's
activations, measured from keep), and at K+1 inside it: keep (expected out of memory), full
recompute, adaptive, offload. A point that needs more drive space or host memory than the box
has, or comes when the step's time is nearly up, is not run and says why; results are saved
after every point, so a step stopped by its time limit keeps what it measured.
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

from gpu_check_steps import GiB, GpuGPT, deadline_left
from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime, installed_step


class StallProbe:
    """Seconds the training thread spends waiting on the offloader's IO: every such wait
    (back-pressure in pack, a read in unpack, a budget wait, the end-of-step wait for writes and
    reads) goes through ``Transfers._next_event``, which blocks on the IO threads' event queue;
    StepStats.io_wait_s leaves the end-of-step wait out. Where that method is gone (the data
    path was reshaped), ``source`` says so and the stats are used instead."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real = None
        self.source = "Transfers._next_event on the training thread"

    def __enter__(self) -> "StallProbe":
        from ssdtrain_megatron.cache.transfers import Transfers

        real = getattr(Transfers, "_next_event", None)
        if real is None:
            self.source = "StepStats io_wait_s + budget_wait_s (Transfers._next_event not found)"
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
        Transfers._next_event = timed_next_event
        return self

    def __exit__(self, *exc) -> None:
        from ssdtrain_megatron.cache.transfers import Transfers

        if self._real is not None:
            Transfers._next_event = self._real
            self._real = None

    @property
    def works(self) -> bool:
        return self._real is not None


def _pinned_bandwidth(device: torch.device, nbytes: int = GiB) -> dict:
    """Bytes per second of one pinned host<->device copy (what the memory engine's link allows)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in (("write", (host, dev)), ("read", (dev, host))):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 3 * nbytes / (time.perf_counter() - t0)
    return out


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

    def __init__(self, args, save: Callable[[dict], None], model: GpuGPT, device: torch.device) -> None:
        self.args, self.save, self.model, self.dev = args, save, model, device
        self.result: Dict[str, object] = {"points": []}
        self.total = torch.cuda.get_device_properties(device).total_memory
        self.host_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.base_cfg = OffloadConfig(dirs=[args.scratch], engine="posix")
        self.per_sample: Optional[float] = None  # one sample's activations, once keep has run
        self.probe = StallProbe()

    def _skip(self, mb: int, policy: str, engine: str, cfg_kw: dict) -> Optional[str]:
        need = self.per_sample * mb * 1.1 if self.per_sample else 0
        free = shutil.disk_usage(self.args.scratch).free
        if deadline_left() < 20:
            return "not run: out of time"
        if policy != "keep" and engine == "posix" and need > free:
            return f"not run (disk): needs about {need / 1e9:.0f} GB on the drive, {free / 1e9:.0f} GB free"
        if cfg_kw.get("host_memory_bytes", 0) > 0.75 * self.host_ram:
            return (f"not run (host memory): a {cfg_kw['host_memory_bytes'] / 1e9:.0f} GB pinned pool, "
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
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / self.total) if budget else 1.0, self.dev)
            self.model.set_micro_batch(mb)
            self.model.set_recompute(recompute)
            off = None
            try:
                off = ActivationOffloader(self.base_cfg.replace(policy=policy, engine=engine, job=f"gc-{name}-{mb}",
                                                                **cfg_kw), device=self.dev)
                for _ in range(warmup):
                    installed_step(self.model, off)
                p.update(self._timed(off, mb))
            except torch.cuda.OutOfMemoryError as exc:
                p.update(ok=False, oom=True, error=str(exc).splitlines()[0][:300])
            except Exception as exc:  # noqa: BLE001 - one point failing does not end the step
                p.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
            finally:
                if off is not None:
                    off.close()
                self.model.optimizer.zero_grad(set_to_none=True)
                self.model.set_recompute(False)
                torch.cuda.set_per_process_memory_fraction(1.0, self.dev)
        self.result["points"].append(p)
        self.save(dict(self.result, status="running"))
        print(f"measure: {p}", flush=True)
        return p

    def _timed(self, off: ActivationOffloader, mb: int) -> dict:
        """--steps steady-state steps: peak memory (reserved and allocated), time, bytes, and the
        training thread's time blocked on the offloader (StallProbe; the stats' own io_wait_s
        and budget_wait_s beside it)."""
        torch.cuda.reset_peak_memory_stats(self.dev)
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
        n = len(times)
        stall = self.probe.seconds - probed if self.probe.works else stats_wait
        step_s = statistics.median(times)
        return dict(ok=True, step_s=step_s, times=times, peak_bytes=torch.cuda.max_memory_allocated(self.dev),
                    peak_reserved=torch.cuda.max_memory_reserved(self.dev), stall_s=stall / n,
                    stall_fraction=stall / sum(times), stall_source=self.probe.source,
                    stats_wait_s=stats_wait / n, submit_s=submit / n,
                    resident_after_step=torch.cuda.memory_allocated(self.dev),
                    tokens_per_s=mb * self.model.spec.seq / step_s, bytes_written=written / n, bytes_read=read / n,
                    fallbacks=st.fallbacks)


def step_measure(args, save) -> dict:
    k = args.micro_batch
    spec = GPTSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                   micro_batch=k, num_microbatches=1)
    with MegatronRuntime() as rt, StallProbe() as probe:
        m = Measure(args, save, GpuGPT(spec, rt.device), rt.device)
        m.probe = probe
        r = m.result
        r.update(spec=dataclasses.asdict(spec), micro_batch=k,
                 bandwidth={"memory": _pinned_bandwidth(rt.device), **({"posix": _drive_bandwidth(args.out)}
                                                                        if _drive_bandwidth(args.out) else {})})
        save(dict(r, status="running"))
        # Keep first: its peak minus what stays resident after a step (weights, gradients,
        # optimizer state) is K samples' activations.
        keep = m.point("keep", k, "keep")
        if not keep.get("ok"):
            return dict(r, status="fail", why=f"keep at micro-batch {k} failed: {keep.get('error')}")
        resident = keep["resident_after_step"]
        activation = max(keep["peak_bytes"] - resident, 1) / k
        m.per_sample = activation
        budget = int(resident + (k + 0.5) * activation)
        r.update(resident_bytes=resident, activation_bytes_per_sample=activation, budget_bytes=budget)
        pool = lambda mb: int((mb + 0.25) * activation + GiB)  # noqa: E731
        m.point("offload-memory", k, "offload", "memory", host_memory_bytes=pool(k))
        m.point("offload-posix", k, "offload", "posix")
        m.point("recompute", k, "keep", recompute=True)
        m.point("keep", k + 1, "keep", budget=budget)
        m.point("recompute", k + 1, "keep", recompute=True, budget=budget)
        m.point("adaptive", k + 1, "adaptive", "posix", budget=budget, warmup=2,
                memory_budget_bytes=int(0.5 * activation), recompute_fallback=True)
        m.point("offload-memory", k + 1, "offload", "memory", budget=budget, host_memory_bytes=pool(k + 1))
        m.point("offload-posix", k + 1, "offload", "posix", budget=budget)
    return dict(r, status="pass")
