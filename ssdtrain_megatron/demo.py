"""`ssdtrain demo`: train a small GPT on CPU with SSD offload and show what happened.

Runs the same steps twice, side by side: with ``policy="keep"`` (the baseline: the offloader
installed, nothing offloaded) and with the chosen policy, checks that losses are bitwise equal,
and prints per-step IO statistics and the memory / time ratios.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import List

import torch

from .cache import ActivationOffloader
from .config import OffloadConfig
from .demo_model import TinyGPT, lm_loss


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small GPT on CPU with SSD offload",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="./ssd-offload-demo", help="offload root (default: %(default)s)")
    p.add_argument("--steps", type=_positive, default=3, help="training steps (default: %(default)s)")
    p.add_argument("--micro-batches", type=_positive, default=4, help="micro-batches per step")
    p.add_argument("--micro-batch-size", type=_positive, default=4)
    p.add_argument("--layers", type=_positive, default=8)
    p.add_argument("--hidden", type=_positive, default=256)
    p.add_argument("--heads", type=_positive, default=4)
    p.add_argument("--seq", type=_positive, default=256)
    p.add_argument("--policy", choices=["offload", "keep"], default="offload")
    p.add_argument("--config", help="YAML OffloadConfig (the demo's --dir overrides its dirs)")
    p.set_defaults(func=run_demo)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _train(model: TinyGPT, batches: List[torch.Tensor], off: ActivationOffloader, steps: int, label: str):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = []
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb, tokens in enumerate(batches):
            with off.microbatch(mb):
                loss = lm_loss(model(tokens, off.layer), tokens)
            off.begin_backward(mb)
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        opt.step()
        st = off.end_step()
        dt = time.perf_counter() - t0
        rows.append((total, st, dt))
        print(f"[{label}] step {step + 1}/{steps}  loss {total:.4f}  {dt:.2f}s  {st.summary()}", file=sys.stderr)
    return rows


def run_demo(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, hidden=args.hidden, heads=args.heads, layers=args.layers, seq=args.seq)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (args.micro_batch_size, args.seq), generator=g)
               for _ in range(args.micro_batches)]
    base = OffloadConfig.from_yaml(args.config) if args.config else OffloadConfig()
    cfg = base.replace(dirs=[os.path.abspath(args.dir)], policy=args.policy)
    print(f"ssdtrain demo: GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"{args.micro_batches} micro-batches of {args.micro_batch_size}; offload root {cfg.dirs[0]}")
    with ActivationOffloader(cfg.replace(policy="keep")) as off:
        keep = _train(model, batches, off, args.steps, "keep")
    with ActivationOffloader(cfg) as off:
        print(f"writing to {', '.join(off.rank_dirs)} (engine {cfg.engine}, "
              f"page cache bypassed: {getattr(off.engine, 'page_cache_bypassed', 'n/a')})")
        ours = _train(model, batches, off, args.steps, args.policy)
    same = all(a[0] == b[0] for a, b in zip(keep, ours))
    print()
    print(f"{'step':>4} {'loss':>10} {'offloaded MB':>13} {'read MB':>9} {'write GB/s':>11} "
          f"{'read GB/s':>10} {'io wait ms':>11} {'peak act MB':>12} {'step s':>7}")
    for i, (loss, st, dt) in enumerate(ours):
        print(f"{i + 1:>4} {loss:>10.4f} {st.bytes_offloaded / 1e6:>13.1f} {st.bytes_read / 1e6:>9.1f} "
              f"{st.write_gbps:>11.2f} {st.read_gbps:>10.2f} {st.io_wait_s * 1e3:>11.1f} "
              f"{st.peak_resident_bytes / 1e6:>12.1f} {dt:>7.2f}")
    # Skip the first (warm-up) step in the time ratio when there is more than one.
    k = 1 if args.steps > 1 else 0
    t_keep = sum(r[2] for r in keep[k:])
    t_ours = sum(r[2] for r in ours[k:])
    peak_keep = max(r[1].peak_resident_bytes for r in keep)
    peak_ours = max(r[1].peak_resident_bytes for r in ours)
    print()
    print(f"losses bitwise equal to keep: {same}")
    print(f"peak resident activations: {peak_ours / 1e6:.1f} MB vs keep {peak_keep / 1e6:.1f} MB "
          f"(ratio {peak_ours / max(peak_keep, 1):.2f})")
    print(f"step time: {t_ours:.2f}s vs keep {t_keep:.2f}s (ratio {t_ours / max(t_keep, 1e-9):.2f})")
    left = [f for _, _, fs in os.walk(cfg.dirs[0]) for f in fs]
    print(f"files left under {cfg.dirs[0]}: {len(left)}")
    return 0 if same and not left else 1
