"""`ssdtrain core-bench`: what the offloader costs the training thread, and what it saves.

Prints, from one run:
- pack-hook CPU time per saved tensor on the calling thread (thread CPU time, so other
  processes on the machine do not inflate it), for tensors passed through, kept, and
  offloaded (hook + hand-off to the engine; the IO itself runs on the engine's threads);
- peak resident activation bytes of the small GPT with ``policy="offload"`` vs ``"keep"``,
  steps of the two policies alternating so that machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
from typing import Dict

from .cli_types import deprecated_alias
from .config import OffloadConfig

# torch, the offloader and the model are imported inside the functions: `ssdtrain --help`
# builds this command's parser and must not pay for torch.


def add_core_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("core-bench", help="pack-hook cost per tensor; peak memory offload vs keep",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="./ssd-offload-bench", help="offload root (default: %(default)s)")
    p.add_argument("--tensors", type=int, default=2000, help="saved tensors per hook measurement")
    p.add_argument("--tensor-kib", dest="tensor_kb", type=int, default=256,
                   help="size of each saved tensor, KiB (default 256)")
    deprecated_alias(p, "--tensor-kb", "--tensor-kib", "tensor_kb", int)
    p.add_argument("--steps", type=int, default=3, help="steps per policy for the memory comparison")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_core_bench)


def hook_cost_us(cfg: OffloadConfig, policy: str, n: int, nbytes: int) -> float:
    """Thread CPU µs per saved tensor spent in the pack hook under ``policy``.

    The hook is called directly on ``n`` distinct activations made beforehand, so only the
    hook is timed (thread CPU time: other processes on the machine do not count). For
    ``offload`` that includes handing the tensor to the engine, not the IO itself, which runs
    on the engine's threads."""
    import torch

    from .cache import ActivationOffloader

    min_bytes = nbytes + 1 if policy == "pass-through" else 0
    c = cfg.replace(policy="keep" if policy != "offload" else "offload", min_tensor_bytes=min_bytes,
                    keep_last_layers=0, max_inflight_bytes=max(cfg.max_inflight_bytes, 2 * n * nbytes))
    src = torch.randn(nbytes // 4, requires_grad=True)
    tensors = [src.mul(1.0) for _ in range(n)]  # activations: distinct storages, with grad_fn
    with ActivationOffloader(c) as off:
        with off.microbatch(0):
            handles = [off._pack(tensors[0])]  # warm up the engine threads
            t0 = time.thread_time()
            handles += [off._pack(t) for t in tensors[1:]]
            spent = time.thread_time() - t0
        del handles, tensors
        off.end_step()
    return spent / max(n - 1, 1) * 1e6


def peak_memory(cfg: OffloadConfig, steps: int) -> Dict[str, dict]:
    import torch

    from .cache import ActivationOffloader
    from .demo_model import TinyGPT, lm_loss

    torch.manual_seed(0)
    model = TinyGPT(vocab=512, hidden=256, heads=4, layers=8, seq=256)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (4, 256), generator=g) for _ in range(2)]
    out: Dict[str, dict] = {}
    offs = {p: ActivationOffloader(cfg.replace(policy=p)) for p in ("keep", "offload")}
    models = {p: copy.deepcopy(model) for p in offs}
    times: Dict[str, list] = {p: [] for p in offs}
    peaks: Dict[str, int] = {p: 0 for p in offs}
    try:
        for step in range(steps):
            for p, off in offs.items():  # alternate policies step by step
                t0 = time.perf_counter()
                for mb, tokens in enumerate(batches):
                    with off.microbatch(mb):
                        loss = lm_loss(models[p](tokens, off.layer), tokens)
                    off.begin_backward(mb)
                    loss.backward()
                st = off.end_step()
                times[p].append(time.perf_counter() - t0)
                peaks[p] = max(peaks[p], st.peak_resident_bytes)
                print(f"step {step + 1}/{steps} {p}: {st.summary()}", file=sys.stderr)
    finally:
        for off in offs.values():
            off.close()
    for p in offs:
        rest = times[p][1:] or times[p]
        out[p] = {"peak_resident_bytes": peaks[p], "step_s": sorted(rest)[len(rest) // 2]}
    return out


def run_core_bench(args: argparse.Namespace) -> int:
    cfg = OffloadConfig(dirs=[os.path.abspath(args.dir)])
    nbytes = args.tensor_kb * 1024
    hooks, hooks_frozen = {}, {}
    for policy in ("pass-through", "keep", "offload"):
        hooks[policy] = hook_cost_us(cfg, policy, args.tensors, nbytes)
        # Python's cyclic GC traverses the whole heap (torch, megatron) in its full collections,
        # and the hook's allocations trigger them; Megatron's --manual-gc (or gc.freeze()) takes
        # that away. Measure both.
        gc.collect()
        gc.freeze()
        try:
            hooks_frozen[policy] = hook_cost_us(cfg, policy, args.tensors, nbytes)
        finally:
            gc.unfreeze()
        print(f"pack hook, {policy}: {hooks[policy]:.1f} µs/tensor "
              f"({hooks_frozen[policy]:.1f} after gc.freeze())", file=sys.stderr)
    mem = peak_memory(cfg, args.steps)
    result = {
        "hook_us_per_tensor": hooks,
        "hook_us_per_tensor_gc_frozen": hooks_frozen,
        "tensor_bytes": nbytes,
        "peak_resident_bytes": {p: v["peak_resident_bytes"] for p, v in mem.items()},
        "peak_ratio_offload_vs_keep": mem["offload"]["peak_resident_bytes"] / max(mem["keep"]["peak_resident_bytes"], 1),
        "step_s": {p: v["step_s"] for p, v in mem.items()},
        "step_ratio_offload_vs_keep": mem["offload"]["step_s"] / max(mem["keep"]["step_s"], 1e-9),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"pack-hook CPU time per saved tensor ({args.tensor_kb} KiB, calling thread):")
    print(f"  {'':<13} {'as is':>8}   {'heap frozen (gc.freeze / --manual-gc)':>8}")
    for p, us in hooks.items():
        print(f"  {p:<13} {us:8.1f} µs {hooks_frozen[p]:8.1f} µs")
    print("small GPT (8 layers, hidden 256, seq 256, 2 micro-batches of 4), policies alternating:")
    for p in ("keep", "offload"):
        print(f"  {p:<8} peak resident {mem[p]['peak_resident_bytes'] / 1e6:8.1f} MB   "
              f"median step {mem[p]['step_s']:.2f}s")
    print(f"  offload/keep: peak resident {result['peak_ratio_offload_vs_keep']:.2f}, "
          f"step time {result['step_ratio_offload_vs_keep']:.2f}")
    return 0
