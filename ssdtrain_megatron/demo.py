"""`ssdtrain demo`: train a small megatron-core GPT with SSD offload and show what happened.

A minimal pretraining loop built from megatron-core parts (GPTModel with the local layer spec,
Adam, megatron's pipeline schedule, mock data), on the CPU when there is no CUDA. Two copies of
the model train side by side, step by step: one with ``policy="offload"`` into ``--dir`` and one
with ``policy="keep"`` (the offloader installed, nothing offloaded: the baseline). Their losses
must be bitwise equal. Prints one line of statistics per step, then the memory and step-time
ratios, and writes a plot of resident activation memory over a step with and without offload.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

from .cache import ActivationOffloader
from .cli_types import positive_int, progress_bar
from .config import OffloadConfig


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small megatron-core GPT with SSD offload (CPU ok)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="./ssd-offload-demo", help="offload root (default: %(default)s)")
    p.add_argument("--config", help="YAML preset (e.g. configs/cpu-tiny.yaml): its offload: section; "
                                    "--dir replaces its dirs")
    p.add_argument("--steps", type=positive_int, default=4, help="training steps (default: %(default)s)")
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=256)
    p.add_argument("--micro-batch-size", type=positive_int, default=4)
    p.add_argument("--micro-batches", type=positive_int, default=4, help="micro-batches per step")
    p.add_argument("--plot", default=None, help="PNG of memory over a step (default: DIR/memory.png)")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from .megatron.minigpt import GPTSpec, MegatronRuntime, MiniGPT, installed_step

    base = OffloadConfig.from_yaml(args.config) if args.config else OffloadConfig()
    root = os.path.abspath(args.dir)
    cfg = base.replace(dirs=[root], policy="offload")
    spec = GPTSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                   micro_batch=args.micro_batch_size, num_microbatches=args.micro_batches)
    print(f"ssdtrain demo: megatron-core GPT, {spec.layers} layers, hidden {spec.hidden}, seq {spec.seq}, "
          f"{spec.num_microbatches} micro-batches of {spec.micro_batch} per step; offload root {root}")
    rows: Dict[str, List[tuple]] = {"keep": [], "offload": []}
    timelines: Dict[str, list] = {}
    with MegatronRuntime() as rt:
        models = {p: MiniGPT(spec, rt.device) for p in rows}
        offs = {"keep": ActivationOffloader(cfg.replace(policy="keep")), "offload": ActivationOffloader(cfg)}
        try:
            print(f"device {rt.device}; offload files in {', '.join(offs['offload'].rank_dirs)} "
                  f"(engine {cfg.engine}, page cache bypassed: "
                  f"{getattr(offs['offload'].engine, 'page_cache_bypassed', 'n/a')})")
            for off in offs.values():
                off.enable_memory_timeline()
            for step in range(args.steps):
                for policy in ("keep", "offload"):  # alternate, so machine noise hits both alike
                    off = offs[policy]
                    loss, dt = installed_step(models[policy], off)
                    rows[policy].append((loss, off.last_step_stats, dt))
                    timelines[policy] = off.last_memory_timeline
                st = rows["offload"][-1][1]
                print(f"{progress_bar(step + 1, args.steps)} step {step + 1}: loss {rows['offload'][-1][0]:.4f}, "
                      f"offloaded {st.bytes_offloaded / 1e6:.1f} MB, read {st.bytes_read / 1e6:.1f} MB, "
                      f"write {st.write_gbps:.2f} GB/s, read {st.read_gbps:.2f} GB/s, "
                      f"io wait {st.io_wait_s * 1e3:.0f} ms, peak resident {st.peak_resident_bytes / 1e6:.1f} MB "
                      f"(keep {rows['keep'][-1][1].peak_resident_bytes / 1e6:.1f} MB), "
                      f"{rows['offload'][-1][2]:.2f}s (keep {rows['keep'][-1][2]:.2f}s)", file=sys.stderr)
        finally:
            for off in offs.values():
                off.close()
    same = [a[0] for a in rows["keep"]] == [b[0] for b in rows["offload"]]
    skip = 1 if args.steps > 1 else 0  # the first step warms up allocator and page tables
    t = {p: sorted(r[2] for r in rows[p][skip:]) for p in rows}
    med = {p: v[len(v) // 2] for p, v in t.items()}
    peak = {p: max(r[1].peak_resident_bytes for r in rows[p]) for p in rows}
    total_w = sum(r[1].bytes_offloaded for r in rows["offload"])
    total_r = sum(r[1].bytes_read for r in rows["offload"])
    print()
    print(f"saved to SSD: {total_w / 1e6:.1f} MB written, {total_r / 1e6:.1f} MB read back over "
          f"{args.steps} steps; last step write {rows['offload'][-1][1].write_gbps:.2f} GB/s, "
          f"read {rows['offload'][-1][1].read_gbps:.2f} GB/s")
    print(f"losses bitwise equal to keep: {same}")
    print(f"peak resident activations: offload {peak['offload'] / 1e6:.1f} MB vs keep {peak['keep'] / 1e6:.1f} MB "
          f"(ratio {peak['offload'] / max(peak['keep'], 1):.2f})")
    print(f"median step time: offload {med['offload']:.2f}s vs keep {med['keep']:.2f}s "
          f"(ratio {med['offload'] / max(med['keep'], 1e-9):.2f})")
    plot = args.plot or os.path.join(root, "memory.png")
    if _plot(timelines, plot):
        print(f"memory over the last step: {plot}")
    left = [f for _, _, fs in os.walk(root) for f in fs if not f.endswith(".png")]
    print(f"offload files left under {root}: {len(left)}")
    return 0 if same and not left else 1


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
    ax.set_title("Activation memory over one training step")
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return True
