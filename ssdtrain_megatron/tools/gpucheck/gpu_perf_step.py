"""The measure step of `make gpu-perf` (gpu_perf.py): both shapes, one after the other,
in one process (gpu_perf_plan.py says why), every strategy, through the measure step's
code (gpu_check_measure.py). Each shape gets a share of the step's time in proportion
to its estimate, and its own result under ``shapes``, saved after every point; a shape that
fails leaves the other its time. Every GPU call goes through a ``CudaBox``, which the CPU test
replaces with stand-ins (tests/test_gpu_perf.py)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time
import traceback
from typing import Callable, Dict, Optional

import torch

from .gpu_check_common import CudaBox, GpuGPT, deadline_left
from .gpu_check_measure import Measure, StallProbe
from .gpu_check_plan import ADAPTIVE_EXPLORE_STEPS, ADAPTIVE_TRIAL_STEPS, parameters, points_estimate, reserves
from .gpu_check_runner import SAVE_ON_CPU
from .gpu_perf_model import predictions
from .gpu_check_sdpa import choose_backend
from .gpu_perf_plan import SHAPES, flop_per_saved_byte, points, shares
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime

ADAPTIVE_KEEPS = 0.5  # adaptive's budget: this fraction of keep's activations
STEP_END_S = 5  # the step's own work after the last shape (saving the result)


def measure_shape(args: argparse.Namespace, save: Callable[[dict], None], box: CudaBox, name: str,
                  until: float, device: torch.device, probe: StallProbe) -> dict:
    """One shape: keep, offload (memory, posix) with the bounds' rates, save_on_cpu, full
    recompute, adaptive; each point judged against its bound, and the model's prediction."""
    shape = SHAPES[name]
    k = shape["micro_batch"]
    fields = {f.name for f in dataclasses.fields(GPTSpec)}
    spec = GPTSpec(**{n: v for n, v in shape.items() if n in fields})
    t0 = time.perf_counter()
    backend = choose_backend(device, torch.bfloat16, spec.heads, spec.hidden // spec.heads) \
        if shape["attention"] == "sdpa" else None
    chose_s = time.perf_counter() - t0
    model = GpuGPT(spec, device, attention=shape["attention"], grad_buffers=True, sdpa_backend=backend)
    m = Measure(args, save, model, device, box, trace_dir=os.path.join(args.out, "traces", name), until=until,
                estimates=reserves(points_estimate(shape, points(name, args.steps))))
    m.probe = probe
    r = m.result
    r.update(shape=shape, micro_batch=k, registration_works=m.registers, flop_per_saved_byte=flop_per_saved_byte(shape),
             parameters=parameters(shape), gpu_memory_bytes=m.total, attention_backend=backend,
             attention_backend_choice_s=round(chose_s, 3) if backend else None)
    save(dict(r, status="running"))
    try:
        keep = m.offload_points(k)
        if backend:  # the kernel's first step (its plan built, cuDNN's graph) against a steady one
            r["attention_first_step_s"] = keep.get("first_step_s")
        if not keep.get("ok"):
            return dict(r, status="fail", why=f"keep at micro-batch {k} failed: {keep.get('error')}")
        m.point("save_on_cpu", k, SAVE_ON_CPU)
        m.point("recompute", k, "keep", recompute=True)
        adaptive_budget = int(ADAPTIVE_KEEPS * k * m.per_sample)
        m.point("adaptive", k, "adaptive", "memory", memory_budget_bytes=adaptive_budget, recompute_fallback=True,
                adaptive_trial_steps=ADAPTIVE_TRIAL_STEPS, adaptive_explore_steps=ADAPTIVE_EXPLORE_STEPS,
                **m.memory_settings(k))
    finally:
        if m.per_sample is not None:
            # keep ran. What was measured is judged whatever ended the points (the host's work only: it
            # runs after a CUDA error too), so their rows are judged from what exists.
            m.judge(k)
    r["model"] = predictions(m, k, m.memory_settings(k)["host_memory_bytes"], adaptive_budget)
    return dict(r, status="pass")


def step_perf(args: argparse.Namespace, save: Callable[[dict], None], box: CudaBox) -> dict:
    """Every shape of SHAPES in turn (module docstring). What a shape measured is kept
    whatever ends it: its error (with the traceback) is its result's; an error the device
    keeps (a sticky CUDA error: the cleanup between shapes raises too) ends the step, and the
    shapes after it say so."""
    out: Dict[str, object] = {"shapes": {}}
    est = shares(args.steps)

    def save_shape(name: str, result: dict) -> None:
        out["shapes"][name] = result
        save(dict(out, status="running"))

    with MegatronRuntime() as rt, StallProbe() as probe:
        dead: Optional[str] = None  # why the device can run nothing more
        for i, name in enumerate(SHAPES):
            if dead:
                save_shape(name, {"status": "not run", "why": f"the device failed before it: {dead}"})
                continue
            left = deadline_left() - STEP_END_S
            rest = sum(est[n] for n in list(SHAPES)[i:])
            until = time.time() + left * est[name] / rest
            try:
                result = measure_shape(args, lambda r, name=name: save_shape(name, r), box, name, until,
                                       rt.device, probe)
            except Exception as exc:  # noqa: BLE001 - the next shape still runs; the row says why
                traceback.print_exc()
                result = dict(out["shapes"].get(name, {}), status="error", why=f"{type(exc).__name__}: {exc}"[:500],
                              traceback=traceback.format_exc()[-4000:])
            save_shape(name, result)
            try:
                gc.collect()  # this shape's model and optimizer state, before the next is built
                box.empty_cache()
            except Exception as exc:  # noqa: BLE001 - after a sticky error every CUDA call raises
                traceback.print_exc()
                dead = f"{type(exc).__name__}: {exc}"[:500]
                save_shape(name, dict(result, cleanup_error=dead))
    failed = {n: r for n, r in out["shapes"].items() if r.get("status") != "pass"}
    if failed:
        return dict(out, status="fail", why="; ".join(f"{n}: {r.get('why', r.get('status'))}" for n, r in failed.items()))
    return dict(out, status="pass")


def run_step(args: argparse.Namespace, save: Callable[[dict], None], box: Optional[CudaBox] = None) -> dict:
    """The step ``args.child`` ("perf"). ``box``: the GPU calls (default: the real ones, on a
    box with CUDA; the CPU test passes stand-ins)."""
    if args.child != "perf":
        raise ValueError(f"unknown step {args.child!r}")
    if box is None:
        if not torch.cuda.is_available():
            return {"status": "skip", "why": "no CUDA device"}
        box = CudaBox()
    return step_perf(args, save, box)
