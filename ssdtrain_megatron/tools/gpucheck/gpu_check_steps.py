"""The steps of `make gpu-check` that need torch and the GPU (see gpu_check.py).

Each step runs in its own process and returns one dict (``status``: pass, fail, skip, or not
run with the reason); long steps also ``save`` partial results as they go, so a step killed by
its timeout still leaves what it measured. Every GPU call goes through a
:class:`~gpu_check_common.CudaBox` (``box``), which the CPU test replaces with stand-ins.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import os
import sys
from typing import Callable, Dict, Optional

import torch

from .gpu_check_common import CudaBox, GpuGPT, bits, deadline_left, deterministic, grads, offload_config, same
from .gpu_check_plan import (BITWISE_DELAY_CYCLES, BITWISE_SHAPE, BITWISE_STEPS,
                            STRESS_DELAY_CYCLES, STRESS_INFLIGHT, STRESS_SHAPE, STRESS_STEPS, bitwise_settings)
from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime, MiniGPT, installed_step

BITWISE_SPEC = GPTSpec(**BITWISE_SHAPE)
STRESS_SPEC = GPTSpec(**STRESS_SHAPE)
NVIDIA_FS = "/proc/driver/nvidia-fs/stats"  # present where the GPUDirect Storage driver is loaded


def step_env(args, save) -> dict:
    out: Dict[str, object] = {"python": sys.version.split()[0], "torch": torch.__version__,
                              "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    problems = []
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if major_minor < (2, 11):
        problems.append(f"torch {torch.__version__} < 2.11")
    if torch.version.cuda is None or not torch.version.cuda.startswith("13"):
        out["note"] = f"torch built for CUDA {torch.version.cuda}, the wheels carried are cu13"
    if not torch.cuda.is_available():
        problems.append("torch.cuda.is_available() is False")
    else:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_memory_bytes=p.total_memory, gpus=torch.cuda.device_count())
    os.makedirs(args.scratch, exist_ok=True)
    st = os.statvfs(args.scratch)
    out["scratch_free_bytes"] = st.f_bavail * st.f_frsize
    try:
        out["host_memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    out["status"] = "fail" if problems else "pass"
    if problems:
        out["why"] = "; ".join(problems)
    return out


def kvikio_mode(kvikio) -> str:
    """'compat' where kvikio prefers POSIX IO through its bounce buffers (no GPUDirect
    Storage, or KVIKIO_COMPAT_MODE=ON), else 'direct' (cuFile DMA)."""
    from ssdtrain_megatron.io.gds import configure_kvikio

    return "compat" if configure_kvikio(kvikio, 1) else "direct"


def step_imports(args, save) -> dict:
    """megatron.core and kvikio as this check's steps will import them (the box's packages
    and the bundle installed into <out>/prefix); the mode kvikio prefers; whether the gds
    engine can run."""
    out: Dict[str, object] = {}
    try:
        import megatron.core

        out["megatron_core"] = {"version": getattr(megatron.core, "__version__", "?"), "file": megatron.core.__file__}
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        out["megatron_core"] = {"error": f"import megatron.core failed: {exc!r}"[:500]}
    try:
        import kvikio

        from ssdtrain_megatron.io.gds import gds_unavailable_reason

        out["kvikio"] = {"version": getattr(kvikio, "__version__", "?"), "file": kvikio.__file__,
                         "gds_unavailable": gds_unavailable_reason(), "mode": kvikio_mode(kvikio),
                         "nvidia_fs": os.path.exists(NVIDIA_FS)}
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        out["kvikio"] = {"error": f"import kvikio failed: {exc!r}"[:500]}
    ok = "version" in out["megatron_core"]
    out["status"] = "pass" if ok else "fail"
    if not ok:
        out["why"] = out["megatron_core"]["error"]
    return out


def _gds_ready(engine: str) -> Optional[dict]:
    """None when the gds step can run as named, else its result: skipped (no kvikio), or, for
    the direct step, not run where kvikio prefers compat mode (it would run POSIX IO through
    the page cache and prove nothing of GPUDirect Storage)."""
    from ssdtrain_megatron.io.gds import gds_unavailable_reason

    why = gds_unavailable_reason()
    if why:
        return {"status": "skip", "why": why}
    try:
        kvikio = importlib.import_module("kvikio")  # libkvikio needs rapids-logger and cuFile
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        return {"status": "skip", "why": f"kvikio is installed but does not import: {exc!r}"[:500]}
    mode = kvikio_mode(kvikio)
    if engine == "gds" and mode == "compat":
        driver = "the nvidia-fs driver is loaded" if os.path.exists(NVIDIA_FS) else f"no nvidia-fs driver ({NVIDIA_FS} is absent)"
        return {"status": "not run", "kvikio_mode": mode,
                "why": f"kvikio prefers compat mode here ({driver}): GPUDirect Storage cannot be exercised; "
                       "gds-compat runs the compat path"}
    return None


def step_bitwise(args, save, engine: str, box: CudaBox) -> dict:
    """keep vs offload with ``engine`` (posix, memory, tiered, gds: GPUDirect Storage, or
    gds-compat: kvikio's compat mode, which the parent forces with KVIKIO_COMPAT_MODE=ON)."""
    kind = "gds" if engine.startswith("gds") else engine
    if kind == "gds":
        early = _gds_ready(engine)
        if early is not None:
            return early
    deterministic()
    cfg = offload_config(args, kind, **bitwise_settings(kind))
    out = compare(args, save, BITWISE_SPEC, cfg, BITWISE_STEPS, box, stream=False,
                  delay=box.sleeper(BITWISE_DELAY_CYCLES))
    if kind == "gds" and "kvikio_mode" in out:
        want = "compat" if engine == "gds-compat" else "direct"
        if out["kvikio_mode"] != want and out["status"] == "pass":
            out.update(status="not run", why=f"the gds engine ran in kvikio's {out['kvikio_mode']} mode, not {want}")
    return out


def step_stress(args, save, box: CudaBox) -> dict:
    deterministic()
    cfg = offload_config(args, "posix", min_tensor_bytes=16 * 1024, max_inflight_bytes=STRESS_INFLIGHT,
                         keep_last_layers=0)
    return compare(args, save, STRESS_SPEC, cfg, STRESS_STEPS, box, stream=True,
                   delay=box.sleeper(STRESS_DELAY_CYCLES))


def delay_compute(model: MiniGPT, delay: Callable[[], None], count: Dict[str, int]) -> list:
    """Run ``delay`` on the current stream before each transformer layer's forward, and in
    backward when the gradient of the layer's input is computed (before the layer below
    runs its backward); count both in ``count``. Returns the hook handles."""

    def fwd(module, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        count["forward"] += 1
        delay()
        if isinstance(hs, torch.Tensor) and hs.requires_grad:
            hs.register_hook(bwd)

    def bwd(grad):
        count["backward"] += 1
        delay()

    return [layer.register_forward_pre_hook(fwd, with_kwargs=True) for layer in model.model.decoder.layers]


@contextlib.contextmanager
def counting_stage_out(counts: Dict[str, int]):
    """Inside: every ``DeviceCopy.stage_out`` counted (all, and compact records), whatever
    arguments the offloader passes (a staging copy, or one into an engine's pool view)."""
    from ssdtrain_megatron.cache import device_copy

    real = device_copy.DeviceCopy.stage_out

    def stage_out(self, rec, *args, **kwargs):
        counts["all"] += 1
        counts["n"] += bool(rec.compact)
        return real(self, rec, *args, **kwargs)

    device_copy.DeviceCopy.stage_out = stage_out
    try:
        yield counts
    finally:
        device_copy.DeviceCopy.stage_out = real


def compare(args, save, spec: GPTSpec, cfg: OffloadConfig, steps: int, box: CudaBox, stream: bool,
            delay: Optional[Callable[[], None]] = None) -> dict:
    """keep, keep again (is the baseline itself deterministic?) and offload, step by step,
    each with the compute stream delayed by ``delay`` (see delay_compute) where given, on a
    side stream with ``stream``. Passes only when all ``steps`` ran, bitwise."""
    result: Dict[str, object] = {"engine": cfg.engine, "steps": steps, "spec": dataclasses.asdict(spec)}
    delays = {"forward": 0, "backward": 0}
    mismatch, baseline_mismatch, ran = [], [], 0
    read = written = fallbacks = 0
    with MegatronRuntime() as rt, counting_stage_out({"n": 0, "all": 0}) as compact:
        models = {n: GpuGPT(spec, rt.device) for n in ("keep", "keep2", "offload")}
        hooks = [h for m in models.values() for h in (delay_compute(m, delay, delays) if delay else [])]
        init_same = all(same([bits(p) for p in models["keep"].params], [bits(p) for p in m.params])
                        for m in models.values())
        offs = {"keep": ActivationOffloader(cfg.replace(policy="keep", job="gc-keep"), device=rt.device),
                "keep2": ActivationOffloader(cfg.replace(policy="keep", job="gc-keep2"), device=rt.device),
                "offload": ActivationOffloader(cfg.replace(job="gc-offload"), device=rt.device, streams=box.streams())}
        if offs["offload"].engine is not None and cfg.engine == "gds":
            result["kvikio_mode"] = "direct" if offs["offload"].engine.device_direct else "compat"
        use = box.side_stream(rt.device) if stream else contextlib.nullcontext
        try:
            for i in range(steps):
                got = {}
                for n in models:
                    with use():
                        loss, _ = installed_step(models[n], offs[n])
                    got[n] = (torch.tensor([loss], dtype=torch.float64).view(torch.int64).item(), grads(models[n]))
                st = offs["offload"].last_step_stats
                read += st.bytes_read
                written += st.bytes_offloaded
                fallbacks += st.fallbacks
                ran = i + 1
                if got["keep"][0] != got["keep2"][0] or not same(got["keep"][1], got["keep2"][1]):
                    baseline_mismatch.append(i)
                if got["keep"][0] != got["offload"][0] or not same(got["keep"][1], got["offload"][1]):
                    mismatch.append(i)
                if deadline_left() < 5 and ran < steps:
                    break
        finally:
            for o in offs.values():
                o.close()
            for h in hooks:
                h.remove()
    result.update(init_same=init_same, steps_run=ran, steps_differing=mismatch[:20],
                  baseline_steps_differing=baseline_mismatch[:20], bytes_written=written, bytes_read=read,
                  fallbacks=fallbacks, tensors_staged=compact["all"], compact_tensors=compact["n"],
                  compute_delays=delays)
    return judge_comparison(result, steps, ran, delay is not None, stream)


def judge_comparison(result: dict, steps: int, ran: int, delayed: bool, stream: bool) -> dict:
    """The comparison's verdict: a difference found is a failure however many steps ran; a
    run its time limit stopped before ``steps`` is not run (out of time), with the count."""
    mismatch, baseline_mismatch, read, delays = (result["steps_differing"], result["baseline_steps_differing"],
                                                 result["bytes_read"], result["compute_delays"])
    if not result["init_same"]:
        result.update(status="fail", why="models built with one seed differ: no comparison possible")
    elif baseline_mismatch:
        result.update(status="fail", why=f"keep vs keep already differs at steps {baseline_mismatch[:5]}: "
                      "the baseline is not deterministic here, so bitwise checks are inconclusive")
    elif mismatch:
        result.update(status="fail", why=f"offload differs from keep at steps {mismatch[:5]}")
    elif ran < steps:
        result.update(status="not run", why=f"out of time: {ran} of {steps} steps ran (all bitwise equal)")
    elif read == 0:
        result.update(status="fail", why="nothing was read back from the engine: offload did not happen")
    elif result["fallbacks"]:
        result.update(status="fail", why=f"{result['fallbacks']} writes fell back to memory: not every tensor "
                      "took the path under test")
    elif delayed and not (delays["forward"] and delays["backward"]):
        result.update(status="fail", why=f"the compute stream was not delayed in forward and backward: {delays}")
    elif stream and result["compact_tensors"] == 0:
        result.update(status="fail", why="no compact view was offloaded (the stress needs some)")
    else:
        result.update(status="pass", summary=f"{ran} steps, {read / 1e9:.2f} GB read back, "
                      f"{result['compact_tensors']}/{result['tensors_staged']} compact, "
                      f"compute delayed {delays['forward']} + {delays['backward']} times"
                      + (f", kvikio {result['kvikio_mode']} mode" if "kvikio_mode" in result else ""))
    return result


def step_syncs(args, save, box: CudaBox) -> dict:
    """Synchronisations flagged by torch.cuda.set_sync_debug_mode('warn') on the training
    thread (backward's warnings are re-raised there), per step, after two warm-up steps."""
    deterministic()
    cfg = offload_config(args, "memory", **bitwise_settings("memory"))
    counts, examples = {}, {}
    with MegatronRuntime() as rt:
        for name, policy in (("keep", "keep"), ("offload", "offload")):
            model = GpuGPT(BITWISE_SPEC, rt.device)
            off = ActivationOffloader(cfg.replace(policy=policy, job=f"gc-sync-{name}"), device=rt.device,
                                      streams=box.streams() if policy != "keep" else None)
            try:
                for _ in range(2):
                    installed_step(model, off)
                n_steps = 3
                with box.sync_debug() as syncs:
                    for _ in range(n_steps):
                        installed_step(model, off)
                counts[name] = len(syncs) / n_steps
                examples[name] = sorted(set(syncs))[:5]
            finally:
                off.close()
            del model
            gc.collect()
            box.empty_cache()
    ok = counts["offload"] <= counts["keep"]
    return {"status": "pass" if ok else "fail", "keep_syncs": counts["keep"], "offload_syncs": counts["offload"],
            "examples": examples,
            **({} if ok else {"why": f"offload adds {counts['offload'] - counts['keep']:.1f} syncs per step"})}


def run_step(args: argparse.Namespace, save: Callable[[dict], None], box: Optional[CudaBox] = None) -> dict:
    """The step ``args.child``. ``box``: the GPU calls (default: the real ones, on a box with
    CUDA; the CPU test passes stand-ins)."""
    name = args.child
    if name == "env":
        return step_env(args, save)
    if box is None:
        if not torch.cuda.is_available():
            return {"status": "skip", "why": "no CUDA device"}
        box = CudaBox()
    if name.startswith("bitwise-"):
        return step_bitwise(args, save, name.split("-", 1)[1], box)
    if name == "measure":
        from .gpu_check_measure import step_measure  # gpu_check_measure.py

        return step_measure(args, save, box)
    if name == "optimizer-offload":
        from .gpu_check_optimizer_step import step_optimizer_offload  # gpu_check_optimizer_step.py

        return step_optimizer_offload(args, save, box)
    if name == "cuda-tests":
        from .gpu_check_cuda import step_cuda_tests  # gpu_check_cuda.py

        return step_cuda_tests(args, save)
    fn = {"imports": lambda: step_imports(args, save), "stress": lambda: step_stress(args, save, box),
          "syncs": lambda: step_syncs(args, save, box)}.get(name)
    if fn is None:
        raise ValueError(f"unknown step {name!r}")
    return fn()
