"""`ssdtrain demo`: train a small megatron-core GPT with SSD offload and show what happened.

A minimal pretraining loop built from megatron-core parts (GPTModel with the local layer spec,
Adam, megatron's pipeline schedule, mock data), on the CPU when there is no CUDA. Two copies of
the model train side by side, step by step: one with ``policy="offload"`` into ``--dir`` and one
with ``policy="keep"`` (the offloader installed, nothing offloaded: the baseline). Their losses
must be bitwise equal. Prints the settings that matter, one line of statistics per step, then
the memory and step-time ratios and where the time went, and writes a plot of resident
activation memory over the last step with and without offload.

Both copies run with OMP_WAIT_POLICY=PASSIVE unless the environment sets it, as `ssdtrain
bench` does: on the CPU, torch's OpenMP threads would otherwise busy-wait whenever an IO thread
takes a core, and that spin would count as offload's cost. The header says which policy ran.

Flags follow Megatron's names (--num-layers, --hidden-size, --micro-batch-size,
--num-microbatches, ...). The exit status is 0 when the losses are equal and no offload file is
left, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Tuple

from .demo_report import StepCosts, destination, diagnose
from .cli_types import (PRESET_HELP, UsageError, byte_count, check_engine, deprecated_alias,
                        free_space_line, gib, openmp_wait_policy, plural, positive_int, preset_arg,
                        progress, quiet_megatron_warnings, say, size_or_fraction,
                        writable_dir)


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small megatron-core GPT with SSD offload (CPU ok)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="./ssd-offload-demo",
                   help="offload root: a directory, created if missing (default: %(default)s)")
    p.add_argument("--config", metavar="PRESET", type=preset_arg,
                   help=f"{PRESET_HELP} (e.g. cpu-tiny): its offload: section; --dir replaces its "
                        "dirs; a budget given as a fraction of GPU memory applies on CUDA only")
    p.add_argument("--engine", help="IO engine (default: the preset's, else posix)")
    p.add_argument("--min-tensor-bytes", type=byte_count, default=None, metavar="BYTES",
                   help="saved tensors smaller than this stay in memory, e.g. 64KiB (default: the "
                        "preset's, else 1MiB on CUDA, 256KiB elsewhere)")
    p.add_argument("--activation-budget", type=size_or_fraction, default=None,
                   metavar="SIZE|FRACTION",
                   help="cap on resident activation bytes of the offload run, e.g. 64MiB (a "
                        "fraction of GPU memory, 0.35, applies on CUDA only); default: the preset's")
    p.add_argument("--steps", type=positive_int, default=4,
                   help="training steps per policy; the first is a warm-up (default: %(default)s)")
    shape = p.add_argument_group("model (Megatron's flag names)")
    shape.add_argument("--num-layers", type=positive_int, default=8, help="default: %(default)s")
    shape.add_argument("--hidden-size", type=positive_int, default=256, help="default: %(default)s")
    shape.add_argument("--num-attention-heads", type=positive_int, default=4, help="default: %(default)s")
    shape.add_argument("--seq-length", type=positive_int, default=256, help="default: %(default)s")
    shape.add_argument("--micro-batch-size", type=positive_int, default=4, help="default: %(default)s")
    shape.add_argument("--num-microbatches", type=positive_int, default=4,
                       help="micro-batches per step (default: %(default)s)")
    for old, new in (("--layers", "--num-layers"), ("--hidden", "--hidden-size"),
                     ("--heads", "--num-attention-heads"), ("--seq", "--seq-length"),
                     ("--micro-batches", "--num-microbatches")):
        deprecated_alias(p, old, new, new[2:].replace("-", "_"), positive_int)
    p.add_argument("--plot", default=None, help="PNG of memory over a step (default: DIR/memory.png)")
    p.set_defaults(func=run_demo)


def _config(args: argparse.Namespace, root: str):
    from ..config import OffloadConfig

    base = OffloadConfig.from_yaml(args.config) if args.config else OffloadConfig()
    changes = {"dirs": [root], "policy": "offload"}
    if getattr(args, "activation_budget", None) is not None:
        changes["activation_budget_bytes"] = args.activation_budget
    if args.engine:
        changes["engine"] = args.engine
    if args.min_tensor_bytes is not None:
        changes["min_tensor_bytes"] = args.min_tensor_bytes
    return base.replace(**changes)


def fraction_budget_here(cfg) -> Tuple[object, str]:
    """(config, note). A preset's activation budget given as a fraction of GPU memory
    (llama3-70b: 0.35) is applied on CUDA, where the offloader resolves it; on a CPU it has
    no memory to be a fraction of, so the demo runs without it and says what to pass."""
    budget = cfg.activation_budget_bytes
    if budget is None:
        return cfg, ""
    if not isinstance(budget, float):
        return cfg, f"activation budget {gib(budget)} (offload run; keep runs without one)"
    import torch

    if torch.cuda.is_available():
        return cfg, f"activation budget {budget:g} of the GPU's memory"
    return cfg.replace(activation_budget_bytes=None), (
        f"activation budget: {budget:g} is a fraction of GPU memory; not applied on the CPU "
        "(pass --activation-budget SIZE, e.g. 64MiB for the default model, to run within one)")


def header_lines(cfg, root: str) -> List[str]:
    """The settings of a run that change its numbers, each with its value."""
    from ..io.where import settings

    where = (f"offload to host memory (engine memory: a pool of {gib(cfg.host_memory_bytes)}; no "
             f"offload files under {root})" if cfg.engine == "memory"
             else f"offload root {root}: {free_space_line(root)}")
    return [where,
            settings(cfg, policy=False) + " (min_tensor_bytes: smaller saved tensors "
            "stay in memory)" + (f", stats_path {cfg.stats_path}" if cfg.stats_path else "")]


def run_demo(args: argparse.Namespace) -> int:
    omp = openmp_wait_policy("the demo")  # first: before anything imports torch
    quiet_megatron_warnings()
    root = writable_dir("--dir", args.dir)
    if args.plot and os.path.isdir(args.plot):
        raise UsageError(f"--plot {args.plot}: is a directory; give a .png file name")
    cfg = _config(args, root)  # a bad preset or value fails here, before anything is built
    check_engine("--engine" if args.engine else "engine (from --config)", cfg.engine)
    cfg, budget_note = fraction_budget_here(cfg)
    from importlib.metadata import version

    from ..cache import ActivationOffloader
    from .minigpt import GPTSpec, MegatronRuntime, MiniGPT, installed_step

    spec = GPTSpec(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                   seq=args.seq_length, micro_batch=args.micro_batch_size,
                   num_microbatches=args.num_microbatches)
    if spec.hidden % spec.heads:
        raise UsageError(f"--hidden-size {spec.hidden} is not a multiple of --num-attention-heads {spec.heads}")
    print(f"ssdtrain demo: megatron-core {version('megatron-core')} GPT (local layer spec: no "
          f"Transformer Engine or Apex needed), {spec.layers} layers, hidden {spec.hidden}, "
          f"{spec.heads} heads, seq {spec.seq}; {spec.num_microbatches} micro-batches of "
          f"{spec.micro_batch} per step; {args.steps} steps per policy, the first a warm-up")
    for line in header_lines(cfg, root) + ([budget_note] if budget_note else []):
        print("  " + line)
    args.offload_files.watch(root)
    rows: Dict[str, List[tuple]] = {"keep": [], "offload": []}
    timelines: Dict[str, list] = {}
    with MegatronRuntime() as rt:
        models = {p: MiniGPT(spec, rt.device) for p in rows}
        offs = {"keep": ActivationOffloader(cfg.replace(policy="keep")), "offload": ActivationOffloader(cfg)}
        try:
            files = offs["offload"].rank_dirs
            print(f"  device {rt.device}; " + (
                f"offload files in {', '.join(files)} (page cache bypassed: "
                f"{getattr(offs['offload'].engine, 'page_cache_bypassed', 'n/a')})" if files
                else f"offloaded tensors stay in {destination(cfg.engine)}, no files"))
            if rt.device.type == "cpu":
                print(f"  OpenMP wait policy: {omp}")
            sys.stdout.flush()
            for off in offs.values():
                off.enable_memory_timeline()
            bar = progress(args.steps, desc="demo", unit="step")
            try:
                for step in range(args.steps):
                    for policy in ("keep", "offload"):  # alternate, so machine noise hits both alike
                        off = offs[policy]
                        cpu0, main0 = os.times(), time.thread_time()
                        loss, dt = installed_step(models[policy], off)
                        cpu1, main = os.times(), time.thread_time() - main0
                        cpu = cpu1.user - cpu0.user + cpu1.system - cpu0.system
                        rows[policy].append((loss, off.last_step_stats, dt, cpu, main))
                        timelines[policy] = off.last_memory_timeline
                    say(bar, _step_line(step, args.steps, rows))
                    bar.update(1)
            finally:
                bar.close()
        finally:
            for off in offs.values():
                off.close()
    return _summary(args, rows, timelines, root, cfg)


def _step_line(step: int, steps: int, rows: Dict[str, List[tuple]]) -> str:
    loss, st, dt = rows["offload"][-1][:3]
    keep = rows["keep"][-1]
    fallbacks = f", {plural(st.fallbacks, 'fallback')}" if st.fallbacks else ""
    return (f"step {step + 1}/{steps}{' (warm-up)' if step == 0 and steps > 1 else ''}: loss {loss:.4f}, "
            f"offloaded {st.bytes_offloaded / 1e6:.1f} MB, read {st.bytes_read / 1e6:.1f} MB, "
            f"write {st.write_gbps:.2f} GB/s, read {st.read_gbps:.2f} GB/s, io wait "
            f"{st.io_wait_s * 1e3:.0f} ms{fallbacks}, peak resident {st.peak_resident_bytes / 1e6:.1f} MB "
            f"(keep {keep[1].peak_resident_bytes / 1e6:.1f} MB), {dt:.2f}s (keep {keep[2]:.2f}s)")


def losses_bitwise_equal(a_rows: List[tuple], b_rows: List[tuple]) -> bool:
    """Whether two runs' per-step losses (each row's first item) have the same bits, step for
    step: compared as ``float.hex`` strings (``==`` on floats has 0.0 == -0.0 and nan != nan)."""
    return [float(r[0]).hex() for r in a_rows] == [float(r[0]).hex() for r in b_rows]


def _median(values: List[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2]


def _summary(args: argparse.Namespace, rows: Dict[str, List[tuple]], timelines: Dict[str, list],
             root: str, cfg) -> int:
    off_rows, keep_rows = rows["offload"], rows["keep"]
    same = losses_bitwise_equal(keep_rows, off_rows)
    skip = 1 if args.steps > 1 else 0  # the first step warms up allocator, page tables, threads
    med = {p: _median([r[2] for r in rows[p][skip:]]) for p in rows}
    cpu = {p: _median([r[3] for r in rows[p][skip:]]) for p in rows}
    last = {p: rows[p][-1][1].peak_resident_bytes for p in rows}
    worst = {p: max(r[1].peak_resident_bytes for r in rows[p]) for p in rows}
    total_w = sum(r[1].bytes_offloaded for r in off_rows)
    total_r = sum(r[1].bytes_read for r in off_rows)
    fallbacks = sum(r[1].fallbacks for r in off_rows)
    forwarded = sum(r[1].tensors_forwarded for r in off_rows)
    io_wait = _median([r[1].io_wait_s + r[1].step_end_wait_s for r in off_rows[skip:]])
    end_wait = _median([r[1].step_end_wait_s for r in off_rows[skip:]])
    print()
    print(f"offloaded to {destination(cfg.engine)}: {total_w / 1e6:.1f} MB written, {total_r / 1e6:.1f} MB read back over "
          f"{args.steps} steps ({forwarded} tensors forwarded from memory instead of read: their "
          f"write had not finished or they were still alive); last step write "
          f"{off_rows[-1][1].write_gbps:.2f} GB/s, read {off_rows[-1][1].read_gbps:.2f} GB/s")
    if total_w == 0 and fallbacks == 0:
        import torch

        here = "cuda" if torch.cuda.is_available() else "cpu"  # where the offloaders ran (their default)
        print(f"nothing was offloaded: every saved tensor is smaller than min_tensor_bytes "
              f"({gib(cfg.min_bytes_for(here))}); use a larger model or --min-tensor-bytes")
    if fallbacks:
        print(f"fallbacks: {fallbacks} writes failed (see the warning above: a full disk?) and "
              f"those tensors stayed in memory; the memory saving is smaller than it should be")
    print(f"losses bitwise equal to keep: {same}")
    print(f"peak resident activations, last step (the plot): offload {last['offload'] / 1e6:.1f} MB vs "
          f"keep {last['keep'] / 1e6:.1f} MB (ratio {last['offload'] / max(last['keep'], 1):.2f})"
          + (f"; highest over all steps: offload {worst['offload'] / 1e6:.1f} MB, keep "
             f"{worst['keep'] / 1e6:.1f} MB" if worst != last else ""))
    print(f"median step time{' after the warm-up' if skip else ''}: offload {med['offload']:.2f}s vs "
          f"keep {med['keep']:.2f}s (ratio {med['offload'] / max(med['keep'], 1e-9):.2f})")
    main = {p: _median([r[4] for r in rows[p][skip:]]) for p in rows}
    costs = StepCosts(keep_s=med["keep"], offload_s=med["offload"], io_wait_s=io_wait,
                      handover_s=main["offload"] - main["keep"],
                      other_cpu_s=(cpu["offload"] - main["offload"]) - (cpu["keep"] - main["keep"]))
    print(f"where the time went, per step: offload {costs.extra_s * 1e3:+.0f} ms vs keep; the training "
          f"thread waited on IO {io_wait * 1e3:.0f} ms ({end_wait * 1e3:.0f} ms of it at the step's "
          f"end); CPU time offload {cpu['offload']:.2f}s vs keep "
          f"{cpu['keep']:.2f}s (training thread {costs.handover_s * 1e3:+.0f} ms, other threads "
          f"{costs.other_cpu_s * 1e3:+.0f} ms)")
    print(f"diagnosis: {diagnose(costs, cfg.bandwidth_cap_gbps, _cpu_only())}")
    plot = args.plot or os.path.join(root, "memory.png")
    if _plot(timelines, plot):
        print(f"memory over the last step: {plot}")
    left = [f for _, _, fs in os.walk(root) for f in fs if not f.endswith(".png")]
    print(f"offload files left under {root}: {len(left)}")
    if not same:
        print("ssdtrain demo: the losses with offload differ from keep's: a bug, please report it",
              file=sys.stderr)
    return 0 if same and not left else 1


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def _plot(timelines: Dict[str, list], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    for policy, tl in timelines.items():
        if tl:
            xs = [0.0] + [t for t, _ in tl]
            ys = [0.0] + [b / 1e6 for _, b in tl]
            ax.step(xs, ys, where="post", label=f"policy={policy}")
    ax.set_xlabel("time into the step (s)")
    ax.set_ylabel("resident activations (MB)")
    ax.set_title("Activation memory over the last training step")
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return True
