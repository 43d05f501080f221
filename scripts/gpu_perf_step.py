"""The steps of `make gpu-perf` that need torch and the GPU (scripts/gpu_perf.py): one shape
each (scripts/gpu_perf_plan.py), every strategy, through the measure step's code
(scripts/gpu_check_measure.py). Every GPU call goes through a ``CudaBox``, which the CPU test
replaces with stand-ins (tests/test_gpu_perf.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, Optional

import torch

from gpu_check_common import CudaBox, GpuGPT
from gpu_check_measure import Measure, StallProbe
from gpu_check_plan import ADAPTIVE_EXPLORE_STEPS, ADAPTIVE_TRIAL_STEPS
from gpu_check_runner import SAVE_ON_CPU
from gpu_perf_model import predictions
from gpu_perf_plan import SHAPES, flop_per_saved_byte, parameters
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime

ADAPTIVE_KEEPS = 0.5  # adaptive's budget: this fraction of keep's activations


def step_perf(args: argparse.Namespace, save: Callable[[dict], None], box: CudaBox, shape: dict) -> dict:
    """One shape: keep, offload (memory, posix) with the bounds' rates, save_on_cpu, full
    recompute, adaptive; each point judged against its bound, and the model's prediction."""
    k = shape["micro_batch"]
    fields = {f.name for f in dataclasses.fields(GPTSpec)}
    spec = GPTSpec(**{n: v for n, v in shape.items() if n in fields})
    with MegatronRuntime() as rt, StallProbe() as probe:
        model = GpuGPT(spec, rt.device, attention=shape["attention"], grad_buffers=True)
        m = Measure(args, save, model, rt.device, box, trace_dir=os.path.join(args.out, "traces", args.child))
        m.probe = probe
        r = m.result
        r.update(shape=shape, micro_batch=k, registration_works=m.registers,
                 flop_per_saved_byte=flop_per_saved_byte(shape), parameters=parameters(shape))
        save(dict(r, status="running"))
        keep = m.offload_points(k)
        if not keep.get("ok"):
            return dict(r, status="fail", why=f"keep at micro-batch {k} failed: {keep.get('error')}")
        m.point("save_on_cpu", k, SAVE_ON_CPU)
        m.point("recompute", k, "keep", recompute=True)
        adaptive_budget = int(ADAPTIVE_KEEPS * k * m.per_sample)
        m.point("adaptive", k, "adaptive", "memory", memory_budget_bytes=adaptive_budget, recompute_fallback=True,
                adaptive_trial_steps=ADAPTIVE_TRIAL_STEPS, adaptive_explore_steps=ADAPTIVE_EXPLORE_STEPS,
                **m.memory_settings(k))
        m.judge(k)
        r["model"] = predictions(m, k, m.memory_settings(k)["host_memory_bytes"], adaptive_budget)
    return dict(r, status="pass")


def run_step(args: argparse.Namespace, save: Callable[[dict], None], box: Optional[CudaBox] = None) -> dict:
    """The step ``args.child`` (a shape of gpu_perf_plan.SHAPES). ``box``: the GPU calls
    (default: the real ones, on a box with CUDA; the CPU test passes stand-ins)."""
    if args.child not in SHAPES:
        raise ValueError(f"unknown step {args.child!r}")
    if box is None:
        if not torch.cuda.is_available():
            return {"status": "skip", "why": "no CUDA device"}
        box = CudaBox()
    return step_perf(args, save, box, SHAPES[args.child])
