"""`ssdtrain soak`: train a small megatron-core GPT for N steps with IO faults injected at
random (from a seed) and count what happened to each.

Two runs of the same model, batches and seed: a plain one (no offload: the fault-free
reference) and one offloaded through a FaultyEngine (tools/faults.py) on a posix engine, which
injects, per IO call, write EIO, ENOSPC, short writes, read EIO, short reads, latency spikes
(100x a call) and IO-thread stalls past io_timeout_s. For each step of the offloaded run:

- the step completes: its faults were *survived* (a failed write kept the tensor in memory,
  a failed read was retried, a slow call waited), and its loss and every gradient must be
  bitwise equal to the reference's (a difference is a *lost* step: a wrong tensor);
- the step raises: it *failed loudly* (a read whose retries all failed, an IO timeout). As a
  job would, the offloader is closed (its files must be gone) and the step runs again on a
  new offloader with faults paused (the job's restart), so later steps stay comparable.

Printed (or ``--json``/``--out``): faults injected by kind, survived, failed loudly, lost,
steps bitwise equal, files left after every close; the exit status is 0 only with 0 lost, 0
files left and every survived step bitwise equal.

``--config PRESET`` soaks a preset's kind of model, shrunk to CPU size: its layer count (at
most 4), micro-batch (at most 2), recomputation and SwiGLU are kept, the widths become the
small GPT's, and what a single CPU process cannot run (tensor / pipeline / sequence parallel,
experts, bf16) is named in the result's ``shrunk`` list. The preset's offload settings are
used (its engine, IO threads, prefetch, verify) except what the soak sets so that a tiny model
does IO: policy offload, min_tensor_bytes 4 KiB, chunk_bytes 16 KiB, keep_last_layers 0, no
activation budget. ``--engine`` picks the engine faults go into: posix, aio (DeepNVMe; the
faults are what its C submission path returns) or tiered (its SSD tier).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from typing import Dict, List, Tuple

from .cli_types import PRESET_HELP, preset_arg

# torch and megatron-core are imported when the command runs (`ssdtrain --help` stays light).


def add_soak_parser(subparsers) -> None:
    from .fault_kinds import KINDS

    p = subparsers.add_parser("soak", help="train with IO faults injected; count survived, "
                                           "failed loudly and lost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps (default %(default)s)")
    p.add_argument("--faults", default="all",
                   help=f"comma-separated kinds, or 'all' ({', '.join(KINDS)}); 'none': no faults")
    p.add_argument("--seed", type=int, default=1, help="fault seed (default %(default)s)")
    p.add_argument("--rate", type=float, default=0.002,
                   help="probability per IO call of each error kind (default %(default)s)")
    p.add_argument("--stall-rate", type=float, default=0.0002,
                   help="probability per IO call of a stall past io_timeout_s (default %(default)s)")
    p.add_argument("--io-timeout-s", type=float, default=1.0,
                   help="the offloader's io_timeout_s; stalls last 1.5x it (default %(default)s)")
    p.add_argument("--dir", default=None, help="offload root, created if missing (default: a temporary folder)")
    p.add_argument("--config", metavar="PRESET", default=None, type=preset_arg,
                   help=f"{PRESET_HELP}: its model shrunk to CPU size and its offload settings "
                        "(default: a 2-layer GPT on posix)")
    p.add_argument("--engine", choices=SOAK_ENGINES, default=None,
                   help="engine the faults go into (default: the preset's, else posix)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", metavar="FILE", default=None, help="also write the JSON result to FILE")
    p.set_defaults(func=run_soak)


def _kinds(text: str) -> Tuple[str, ...]:
    from .cli_types import UsageError
    from .fault_kinds import KINDS

    if text == "all":
        return KINDS
    if text == "none":
        return ()
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise UsageError(f"--faults: unknown kind {', '.join(bad)}; expected 'all', 'none' "
                         f"or some of {', '.join(KINDS)}")
    return kinds


SOAK_ENGINES = ("posix", "aio", "tiered")
"""Engines whose IO calls the fault wrapper reaches (memory makes none; gds needs CUDA)."""


def _spec():
    from .minigpt import GPTSpec

    return GPTSpec(layers=2, hidden=64, heads=4, seq=64, vocab=128, micro_batch=2,
                   num_microbatches=2)


def preset_spec(path: str) -> Tuple[object, List[str]]:
    """(GPTSpec, what was shrunk away) for preset ``path``: its kind of model at CPU size.

    Raises:
        UsageError: the preset cannot be read or is invalid (one line, from load_preset).
    """
    from .cli_types import UsageError
    from .minigpt import GPTSpec
    from .plan.cli import load_preset

    try:
        shape, _ = load_preset(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    recompute = shape.recompute if shape.recompute in ("full", "selective") else None
    spec = GPTSpec(layers=min(shape.num_layers, 4), hidden=64, heads=4, seq=64, vocab=128,
                   micro_batch=min(shape.micro_batch, 2), num_microbatches=2, recompute=recompute,
                   swiglu=bool(shape.swiglu), swiglu_fusion=bool(shape.swiglu and shape.swiglu_fusion))
    shrunk = [f"{shape.num_layers} layers -> {spec.layers}",
              f"hidden {shape.hidden}, {shape.heads} heads, seq {shape.seq_len} -> 64, 4, 64"]
    for name, value in (("tp", shape.tp), ("pp", shape.pp), ("cp", shape.cp), ("ep", shape.ep)):
        if value > 1:
            shrunk.append(f"{name} {value} -> 1 (one process)")
    if shape.sequence_parallel:
        shrunk.append("sequence parallel -> off")
    if shape.num_experts:
        shrunk.append(f"{shape.num_experts} experts -> a dense MLP")
    if shape.dtype_bytes != 4:
        shrunk.append("dtype -> fp32")
    return spec, shrunk


def soak_config(args, root: str):
    """The offloader's config: the preset's offload section (or the defaults), with what the
    soak needs for a tiny model to do IO (module docstring)."""
    from ..config import OffloadConfig

    base = OffloadConfig.from_yaml(args.config) if args.config else OffloadConfig()
    engine = args.engine or (base.engine if args.config else "posix")
    if engine not in SOAK_ENGINES:
        from .cli_types import UsageError

        raise UsageError(f"engine {engine!r} (from --config): faults are injected into the IO "
                         f"calls of {', '.join(SOAK_ENGINES)} only; pass --engine")
    changes = dict(dirs=[root], engine=engine, policy="offload", min_tensor_bytes=4096,
                   chunk_bytes=16384, keep_last_layers=0, io_timeout_s=args.io_timeout_s,
                   activation_budget_bytes=None, memory_budget_bytes=None, stats_path=None,
                   trace_path=None, job=None, recompute_fallback=False, recompute_layers=[],
                   create_dirs=True)
    if engine == "tiered":  # a small memory tier: most tensors spill to the SSD, where faults are
        changes["host_memory_bytes"] = min(base.host_memory_bytes, 256 << 10)
    return base.replace(**changes)


def _fingerprint(loss: float, model) -> Tuple[str, str]:
    """(the loss as float.hex, sha256 of every gradient's bytes): bitwise, not approximate."""
    import torch

    h = hashlib.sha256()
    for p in model.params:
        g = p.grad
        h.update(b"-" if g is None else g.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return float(loss).hex(), h.hexdigest()


def _files(root: str) -> List[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


def reference_run(steps: int, device, spec=None) -> List[Tuple[str, str]]:
    """The fault-free run: plain megatron-core training, no offloader."""
    from .minigpt import MiniGPT

    model = MiniGPT(spec or _spec(), device)
    out = []
    for _ in range(steps):
        out.append(_fingerprint(model.step(), model))
    return out


def faulty_run(args, kinds, root: str, device, reference, spec=None, config=None) -> Dict[str, object]:
    """The offloaded run with faults (module docstring); the figures of the result."""
    from .faults import SeededFaults, faulty_offloader
    from .minigpt import MiniGPT, installed_step

    config = config or soak_config(args, root)
    faults = SeededFaults(args.seed, kinds, rate=args.rate, stall_s=1.5 * args.io_timeout_s,
                          stall_rate=args.stall_rate)
    model = MiniGPT(spec or _spec(), device)
    off = faulty_offloader(config, faults)
    r = {"steps": args.steps, "engine": config.engine, "verify": config.verify, "failed_loudly": [],
         "lost_steps": [], "bitwise_equal_steps": 0, "survivable_steps": 0, "files_left": 0,
         "fallbacks": 0, "read_retries": 0, "bytes_offloaded": 0}
    for step in range(args.steps):
        faults.new_step(step)
        try:
            loss, _ = installed_step(model, off)
            stats = off.last_step_stats
            r["fallbacks"] += stats.fallbacks
            r["read_retries"] += stats.read_retries
            r["bytes_offloaded"] += stats.bytes_offloaded
            r["survivable_steps"] += 1
            if _fingerprint(loss, model) == reference[step]:
                r["bitwise_equal_steps"] += 1
            else:
                r["lost_steps"].append(step + 1)
        except Exception as exc:  # noqa: BLE001 - a loud failure is what is counted here
            r["failed_loudly"].append({"step": step + 1, "error": f"{type(exc).__name__}: "
                                       f"{str(exc).splitlines()[0] if str(exc) else ''}"})
            off.close()  # as the job's exit would: the files go
            r["files_left"] += len(_files(root))
            off = faulty_offloader(config, faults)
            faults.enabled = False  # the restarted job redoes the step
            loss, _ = installed_step(model, off)
            faults.enabled = True
            if _fingerprint(loss, model) != reference[step]:
                r["lost_steps"].append(step + 1)
    off.close()
    r["files_left"] += len(_files(root))
    r["faults_injected"] = dict(faults.counts)
    r["faults_total"] = faults.total()
    return r


def run_soak(args: argparse.Namespace) -> int:
    import torch

    from .cli_types import UsageError, check_engine, quiet_megatron_warnings
    from .minigpt import MegatronRuntime

    quiet_megatron_warnings()  # its model runs megatron-core's torch fallbacks, as the demo's
    kinds = _kinds(args.faults)
    if args.steps < 1:
        raise UsageError("--steps: expected at least 1")
    spec, shrunk = preset_spec(args.config) if args.config else (_spec(), [])
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ssdtrain-soak-") as tmp:
        root = args.dir or tmp
        config = soak_config(args, root)
        check_engine("--engine" if args.engine else "engine (from --config)", config.engine)
        with MegatronRuntime() as rt:
            torch.use_deterministic_algorithms(True, warn_only=True)
            reference = reference_run(args.steps, rt.device, spec)
            result = faulty_run(args, kinds, root, rt.device, reference, spec, config)
    result.update(config=args.config, shrunk=shrunk,
                  shape={"layers": spec.layers, "hidden": spec.hidden, "seq": spec.seq,
                         "micro_batch": spec.micro_batch, "recompute": spec.recompute,
                         "swiglu": spec.swiglu})
    failed = len(result["failed_loudly"])
    lost = len(result["lost_steps"]) + result["files_left"]
    ok = lost == 0 and result["bitwise_equal_steps"] == result["survivable_steps"]
    result.update(seed=args.seed, kinds=list(kinds), seconds=round(time.monotonic() - t0, 1),
                  survived_steps=result["survivable_steps"], failed_steps=failed, lost=lost,
                  exit_status=0 if ok else 1)
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    held = args.warnings.summary_line() if getattr(args, "warnings", None) else ""
    if held:  # the warnings held back (tools/quiet.py), said before the summary: it comes last
        print(held, file=sys.stderr)
    print(text if args.json else _summary(result))
    return result["exit_status"]


def _summary(r: Dict[str, object]) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in r["faults_injected"].items())
    return (f"ssdtrain soak: {r['steps']} steps, seed {r['seed']}, {r['seconds']} s, engine "
            f"{r['engine']}, verify {r['verify']}"
            + (f", {r['config']} shrunk to CPU size ({'; '.join(r['shrunk'])})" if r["config"] else "")
            + "\n"
            f"faults injected: {r['faults_total']} ({kinds or 'none'})\n"
            f"survived: {r['survived_steps']} steps ({r['fallbacks']} writes kept in memory, "
            f"{r['read_retries']} reads retried); bitwise equal to the fault-free run: "
            f"{r['bitwise_equal_steps']} of {r['survivable_steps']}\n"
            f"failed loudly: {r['failed_steps']} steps"
            + "".join(f"\n  step {f['step']}: {f['error']}" for f in r["failed_loudly"])
            + f"\nlost: {r['lost']} (wrong steps {r['lost_steps']}, files left {r['files_left']})\n"
            f"exit status: {r['exit_status']}")
