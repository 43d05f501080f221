"""The optimizer-offload step of `make gpu-check`: megatron-core's optimizer CPU offload with
ours in one job, on the GPU (gpu_check_optimizer.py says what it runs and how the row judges
it; the judging is there, pure, and this module only measures).

Two jobs of the same model, seed and batches, megatron-core's DistributedDataParallel and
DistributedOptimizer with ``--optimizer-cpu-offload`` (its HybridDeviceOptimizer: CUDA tensors,
and Transformer Engine's FusedAdam for the GPU part): first with ours installed through the
launcher's install path (``install_from_args``, which reads the optimizer flags through the
one sequence), then alone. What the plan and the pre-flight say of the same command line
(:func:`planned`) runs anywhere: tests/test_gpu_optimizer_row.py runs it on the CPU.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .gpu_check_common import CudaBox, GpuGPT, bits, deadline_left, deterministic
from .gpu_check_optimizer import FRACTION, SHAPE, STEPS, TE_MISSING, launcher_argv, status_of
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime

SPEC = GPTSpec(**SHAPE)


def transformer_engine_missing() -> Optional[str]:
    """Why the step cannot run its path (TE_MISSING), or None where Transformer Engine is there."""
    return None if importlib.util.find_spec("transformer_engine") is not None else TE_MISSING


def launch_namespace(argv: List[str]) -> argparse.Namespace:
    """Megatron's namespace at install for ``argv`` (its flags and ours, one rank)."""
    from ssdtrain_megatron.megatron.args import add_ssd_offload_args
    from ssdtrain_megatron.megatron.follow_node import megatron_namespace

    flags = add_ssd_offload_args(argparse.ArgumentParser()).parse_known_args(list(argv))[0]
    return argparse.Namespace(**vars(megatron_namespace(argv, 1)), **vars(flags), rank=0)


def planned(argv: List[str], cpu_adam_params_per_s: float, link_gbps: float) -> Dict[str, Any]:
    """What the pre-flight and the plan say of ``argv`` on one rank, with the box's CPU AdamW
    rate and pinned link: the host pool, the staging, the optimizer's pinned host bytes and its
    step's seconds (plan/optimizer_step.py: the plan's ``optimizer CPU offload`` row)."""
    from ssdtrain_megatron.megatron.preflight import read_launch
    from ssdtrain_megatron.plan.node import DEFAULT_NODE, load_profile
    from ssdtrain_megatron.plan.optimizer_step import optimizer_step

    settings = read_launch(argv, local_ranks=1, world=1).settings
    node = load_profile(DEFAULT_NODE).replace(cpu_adam_params_per_s=cpu_adam_params_per_s,
                                              host_link_gbps=link_gbps, host_memory_gbps=None)
    step = optimizer_step(settings.shape, node)
    return {"host_pool_bytes": settings.host_pool_bytes, "staging_bytes": settings.config.staging_bytes(),
            "optimizer_pinned_bytes": step.pinned_host_bytes, "optimizer_step_s": step.step_s,
            "optimizer_row": step.to_dict()}


def _digest(params) -> str:
    """sha256 of every gradient's bits (megatron's main_grad where DDP keeps one)."""
    h = hashlib.sha256()
    for p in params:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        h.update(b"-" if g is None else bits(g).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Job:
    """One of the two jobs: GpuGPT's model in megatron-core's DDP with its optimizer offload."""

    def __init__(self, device: torch.device) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.gpt = GpuGPT(SPEC, device)
        self.gpt.optimizer = None  # megatron-core's below steps the parameters
        self.ddp = DistributedDataParallel(
            config=self.gpt.config, module=self.gpt.model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True))
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=SPEC.lr, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
            use_precision_aware_optimizer=True, main_params_dtype=torch.float32, optimizer_cpu_offload=True,
            optimizer_offload_fraction=FRACTION, overlap_cpu_optimizer_d2h_h2d=True), [self.ddp])

    def step(self, iteration: int) -> Dict[str, Any]:
        """One training step: its losses' bits, its gradients' digest and the optimizer
        step's seconds (synchronised either side, as Megatron's ``optimizer`` timer)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        gpt, losses = self.gpt, []

        def forward_step(data_iterator, model):
            b = next(data_iterator)

            def loss_func(output):
                loss = output.float().mean()
                losses.append(loss.detach())
                return loss, {"lm loss": loss.detach()}

            return model(b["tokens"], gpt._positions, gpt._mask, labels=b["labels"]), loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(gpt.batches(iteration)), model=self.ddp,
            num_microbatches=SPEC.num_microbatches, seq_length=SPEC.seq, micro_batch_size=SPEC.micro_batch,
            forward_only=False)
        self.ddp.finish_grad_sync()
        grads = _digest(gpt.params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.optimizer.step()
        torch.cuda.synchronize()
        return {"loss_bits": [int(bits(x.reshape(1))[0]) for x in losses], "grads": grads,
                "optimizer_s": time.perf_counter() - t0}


def pinned_by_torch() -> int:
    """Bytes torch's pinned host allocator holds (active and cached: what it locked)."""
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def empty_host_cache() -> bool:
    """Give torch's cached pinned blocks back (its private call, by either name it had);
    False where this torch has neither."""
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        if hasattr(torch._C, name):
            getattr(torch._C, name)()
            return True
    return False


def run_job(rt: MegatronRuntime, steps: List[dict], install: Optional[Callable[[], Any]],
            after_first: Callable[[], None]) -> None:
    """STEPS steps of a fresh Job into ``steps`` (as they run: what ran stays when time runs
    out); ``install`` (ours, through the launcher) before the first, undone after the last;
    ``after_first`` after the first step's optimizer step."""
    from ssdtrain_megatron.megatron import launch

    job = Job(rt.device)
    inst = install() if install is not None else None
    try:
        for i in range(STEPS):
            if deadline_left() < 3:
                break
            steps.append(job.step(i))
            if i == 0:
                after_first()
    finally:
        if inst is not None:
            launch.uninstall(launch.MEGATRON_LM)
        del job
        gc.collect()
        torch.cuda.empty_cache()


def step_optimizer_offload(args, save: Callable[[dict], None], box: CudaBox) -> dict:
    """The step (module docstring); its result as gpu_check_optimizer.judge reads it."""
    missing = transformer_engine_missing()
    if missing:
        return {"status": "not run", "why": missing}
    from ssdtrain_megatron.io.pinned import pinned_cost
    from ssdtrain_megatron.megatron import host_memory, launch
    from ssdtrain_megatron.tools.cpu_adam import measure_cpu_adam
    from ssdtrain_megatron.tools.node_profile import pinned_copy_gbps

    os.makedirs(args.scratch, exist_ok=True)
    argv = launcher_argv(args.scratch)
    # One figure of free host memory for the pre-flight and install alike (the two read it a
    # moment apart; what they must agree on is the sequence, not /proc/meminfo's noise).
    free = host_memory.measure()
    if free is not None:
        os.environ[host_memory.FREE_ENV] = f"{free.free_bytes}B"
    rate = measure_cpu_adam(1)["params_per_s"]
    h2d, d2h = pinned_copy_gbps(torch.cuda.current_device())
    plan = planned(argv, rate, min(h2d, d2h))
    result: Dict[str, Any] = {"status": "error", "why": "stopped before its end", "argv": argv, "plan": plan,
                              "link_gbps": {"h2d": h2d, "d2h": d2h}}
    save(result)
    deterministic()
    empty_host_cache()  # the link measurement's pinned block, cached: not the job's
    ours: List[dict] = []
    alone: List[dict] = []
    seen: Dict[str, int] = {}
    registers = box.registration_works()

    def install():
        off = launch.install_from_args(launch_namespace(argv), launch.MEGATRON_LM)
        off = getattr(off, "offloader", off)
        seen["install_pool"] = off.config.host_memory_bytes
        seen["staging"] = off.config.staging_bytes()
        return off

    def pinned_now():
        # ours registered at their size where cudaHostRegister works (else in torch's count)
        ours_registered = pinned_cost(seen["install_pool"]) + pinned_cost(seen["staging"]) if registers else 0
        seen["measured"] = pinned_by_torch() + ours_registered
        seen["torch_pinned"] = pinned_by_torch()

    with MegatronRuntime() as rt:
        run_job(rt, ours, install, pinned_now)
        result.update(ours=ours)
        save(result)
        empty_host_cache()  # the first job's pinned blocks, cached
        run_job(rt, alone, None, lambda: None)
    timed = [s["optimizer_s"] for s in ours[1:]]
    result.update(
        pools={"install": seen.get("install_pool"), "preflight": plan["host_pool_bytes"]},
        pinned={"measured": seen.get("measured"), "torch_pinned": seen.get("torch_pinned"),
                "registers": registers, "pool": plan["host_pool_bytes"], "staging": plan["staging_bytes"],
                "optimizer_planned": plan["optimizer_pinned_bytes"]},
        bitwise={"steps": STEPS, "ours": [{k: s[k] for k in ("loss_bits", "grads")} for s in ours],
                 "alone": [{k: s[k] for k in ("loss_bits", "grads")} for s in alone]},
        timing={"measured_s": statistics.median(timed) if timed else None, "planned_s": plan["optimizer_step_s"],
                "cpu_adam_params_per_s": rate, "steps_timed": len(timed)})
    result["status"] = status_of(result)
    result.pop("why")
    if result["status"] == "not run":  # a line had nothing to judge: the row says which
        result["why"] = judge(dict(result, status="pass"))[1]
    return result


__all__ = ["Job", "launch_namespace", "planned", "run_job", "step_optimizer_offload", "transformer_engine_missing"]
