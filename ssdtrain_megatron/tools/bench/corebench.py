"""`ssdtrain core-bench`: what the offloader costs the training thread, and what it saves.

Prints, from one run:
- pack- and unpack-hook CPU time per saved tensor on the calling thread, the median over every
  tensor of ``time.thread_time_ns()`` around each call (thread CPU time, so other processes on
  the machine do not inflate it, and time spent blocked waiting for a read does not count),
  for tensors passed through, kept, and offloaded (hook + hand-off to the engine; the IO
  itself runs on the engine's threads). Offloaded tensors are dropped before they are
  unpacked, so every unpack gets its bytes back from the engine;
- keep and offload in ``--rounds`` rounds of four measurements in the order keep, offload,
  offload, keep: this machine kind's speed drifts up to 2x within minutes, so each round's
  offload-minus-keep ``gap_us`` (pack and unpack, the median over rounds) compares
  measurements made moments apart; ``pack_us``/``unpack_us`` are each policy's median over
  all its measurements;
- peak resident activation bytes of the small GPT with ``policy="offload"`` vs ``"keep"``,
  steps of the two policies alternating so that machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

from ...config import OffloadConfig
from ..cli_types import deprecated_alias, positive_int
from ..gc_freeze import gc_frozen

# torch, the offloader and the model are imported inside the functions: `ssdtrain --help`
# builds this command's parser and must not pay for torch.


def add_core_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("core-bench", help="pack-hook cost per tensor; peak memory offload vs keep",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="./ssd-offload-bench", help="offload root, created if missing (default: %(default)s)")
    p.add_argument("--tensors", type=int, default=2000, help="saved tensors per hook measurement")
    p.add_argument("--tensor-kib", dest="tensor_kb", type=int, default=256,
                   help="size of each saved tensor, KiB (default 256)")
    deprecated_alias(p, "--tensor-kb", "--tensor-kib", "tensor_kb", int)
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds of keep, offload, offload, keep hook measurements (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="steps per policy for the memory comparison")
    p.add_argument("--sweep", type=_counts, default=None, metavar="N,N,...",
                   help="also measure offload pack/unpack at each of these tensor counts per step "
                        "(e.g. 1000,10000) and report flatness = figure at the last / at the first")
    p.add_argument("--gpu-path", action="store_true",
                   help="also time the GPU data path's own Python (staging, events, bookkeeping) with "
                        "streams, events and copies replaced by no-op stand-ins that count their calls: "
                        "gpu_path_pack_us, gpu_path_unpack_us and stream_calls_per_record, per engine "
                        "(memory: copies into its pool; posix: through pinned staging)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_core_bench)


def _counts(text: str) -> List[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) < 2 or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected two or more tensor counts >= 2, comma-separated "
                                         "(e.g. 1000,10000)")
    return counts


def sweep(cfg: OffloadConfig, counts: List[int], nbytes: int) -> dict:
    """Offload pack/unpack medians at each tensor count, and how flat they are: the figure at
    the last count over the one at the first (1.0: the per-tensor cost does not grow with the
    number of tensors a step saves)."""
    pack, unpack = {}, {}
    for n in counts:
        p, u, _ = hook_costs_us(cfg, "offload", n, nbytes)
        pack[str(n)], unpack[str(n)] = p, u
        print(f"sweep: {n} tensors: offload pack {p:.1f} µs, unpack {u:.1f} µs", file=sys.stderr)
    first, last = str(counts[0]), str(counts[-1])
    return {"pack_us": pack, "unpack_us": unpack,
            "flatness": {"pack": pack[last] / max(pack[first], 1e-9),
                         "unpack": unpack[last] / max(unpack[first], 1e-9)}}


def _median(values: List[int]) -> float:
    return float(statistics.median(values)) if values else 0.0


def timer_overhead_ns(n: int = 2001) -> float:
    """Median cost of one ``thread_time_ns()`` pair with nothing between (part of every figure)."""
    out = []
    for _ in range(n):
        t0 = time.thread_time_ns()
        out.append(time.thread_time_ns() - t0)
    return _median(out)


def hook_costs_us(cfg: OffloadConfig, policy: str, n: int, nbytes: int) -> Tuple[float, Optional[float], int]:
    """(median pack µs, median unpack µs or None for pass-through, bytes read back) per saved
    tensor under ``policy``, thread CPU time of the calling thread.

    The hooks are called directly on ``n`` distinct activations made beforehand, so only the
    hooks are timed. For ``offload``, pack includes handing the tensor to the engine, not the
    IO itself, which runs on the engine's threads; before unpacking, every write is waited for
    and the activations are dropped, so unpack gets the bytes back from the engine (in reverse
    order, as backward does; reads start ahead of the unpacks, as prefetch does)."""
    import torch

    from ...cache import ActivationOffloader

    min_bytes = nbytes + 1 if policy == "pass-through" else 0
    c = cfg.replace(policy="keep" if policy != "offload" else "offload", min_tensor_bytes=min_bytes,
                    keep_last_layers=0, max_inflight_bytes=max(cfg.max_inflight_bytes, 2 * n * nbytes))
    src = torch.randn(nbytes // 4, requires_grad=True)
    tensors = [src.mul(1.0) for _ in range(n)]  # activations: distinct storages, with grad_fn
    pack_ns: List[int] = []
    unpack_ns: List[int] = []
    clock = time.thread_time_ns
    with ActivationOffloader(c) as off:
        pack, unpack = off.hooks.pack, off.hooks.unpack  # bound once, as saved_tensors_hooks holds them
        with off.microbatch(0):
            handles = [pack(tensors[0])]  # warm up the engine threads
            for t in tensors[1:]:
                t0 = clock()
                h = pack(t)
                pack_ns.append(clock() - t0)
                handles.append(h)
        off.wait_writes()
        del tensors, t, h
        if policy != "pass-through":
            for i in range(len(handles) - 1, 0, -1):
                h = handles[i]
                handles[i] = None
                t0 = clock()
                unpack(h)  # backward is done with the tensor at once,
                unpack_ns.append(clock() - t0)
                del h  # and drops the handle: the record is released
        del handles
        stats = off.end_step()
    return (_median(pack_ns) / 1e3, _median(unpack_ns) / 1e3 if unpack_ns else None, stats.bytes_read)


def _round_gaps(runs: Dict[str, List[Tuple[float, Optional[float]]]], which: int) -> List[float]:
    """Per round, offload's mean minus keep's mean of figure ``which`` (0 pack, 1 unpack): each
    round made two measurements of each policy, in the order keep, offload, offload, keep."""
    keep, off = runs["keep"], runs["offload"]
    return [(off[2 * r][which] + off[2 * r + 1][which]) / 2 - (keep[2 * r][which] + keep[2 * r + 1][which]) / 2
            for r in range(len(keep) // 2)]


def peak_memory(cfg: OffloadConfig, steps: int) -> Dict[str, dict]:
    import torch

    from ...cache import ActivationOffloader
    from ..demo_model import TinyGPT, lm_loss

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
    cfg = OffloadConfig(dirs=[os.path.abspath(args.dir)], create_dirs=True)  # its own --dir
    nbytes = args.tensor_kb * 1024
    pack: Dict[str, float] = {}
    unpack: Dict[str, float] = {}
    pack_frozen: Dict[str, float] = {}
    unpack_frozen: Dict[str, float] = {}
    bytes_read = 0
    # Keep and offload alternate (module docstring); the gc-frozen figures follow, once each.
    runs: Dict[str, List[Tuple[float, Optional[float]]]] = {"pass_through": [], "keep": [], "offload": []}
    order = ["pass-through"] + ["keep", "offload", "offload", "keep"] * args.rounds
    for i, policy in enumerate(order):
        key = policy.replace("-", "_")
        p_us, up, read = hook_costs_us(cfg, policy, args.tensors, nbytes)
        runs[key].append((p_us, up))
        if policy == "offload":
            bytes_read = min(bytes_read, read) if bytes_read else read
        print(f"[{i + 1}/{len(order)}] {policy}: pack {p_us:.1f} µs/tensor"
              + (f", unpack {up:.1f} µs/tensor" if up is not None else ""), file=sys.stderr)
    for key, figures in runs.items():
        pack[key] = statistics.median(p for p, _ in figures)
        if figures[0][1] is not None:
            unpack[key] = statistics.median(u for _, u in figures)
    gap = {"pack": statistics.median(_round_gaps(runs, 0)), "unpack": statistics.median(_round_gaps(runs, 1))}
    for policy in ("pass-through", "keep", "offload"):
        key = policy.replace("-", "_")
        # Python's cyclic GC traverses the whole heap (torch, megatron) in its full collections,
        # and the hook's allocations trigger them; Megatron's --manual-gc (or gc.freeze()) takes
        # that away. Measure both.
        with gc_frozen():
            pack_frozen[key], up, _ = hook_costs_us(cfg, policy, args.tensors, nbytes)
            if up is not None:
                unpack_frozen[key] = up
        print(f"{policy}: pack {pack[key]:.1f} µs/tensor ({pack_frozen[key]:.1f} after gc.freeze())"
              + (f", unpack {unpack[key]:.1f} µs/tensor ({unpack_frozen[key]:.1f})" if key in unpack else ""),
              file=sys.stderr)
    if bytes_read < (args.tensors - 1) * nbytes:
        raise RuntimeError(f"core-bench: the offload unpacks read back {bytes_read} bytes, expected at least "
                           f"{(args.tensors - 1) * nbytes}: the unpack figure would not include reads")
    timer_us = timer_overhead_ns() / 1e3
    mem = peak_memory(cfg, args.steps)
    peak_ratio = mem["offload"]["peak_resident_bytes"] / max(mem["keep"]["peak_resident_bytes"], 1)
    result = {
        "pack_us": pack,
        "unpack_us": unpack,
        "tensors": args.tensors,
        "tensor_kb": args.tensor_kb,
        "peak_resident_ratio": peak_ratio,
        "gap_us": gap,
        "rounds": args.rounds,
        "pack_us_gc_frozen": pack_frozen,
        "unpack_us_gc_frozen": unpack_frozen,
        "timer_overhead_us": timer_us,
        "offload_bytes_read": bytes_read,
        "peak_resident_bytes": {p: v["peak_resident_bytes"] for p, v in mem.items()},
        "step_s": {p: v["step_s"] for p, v in mem.items()},
        "step_ratio_offload_vs_keep": mem["offload"]["step_s"] / max(mem["keep"]["step_s"], 1e-9),
    }
    if args.sweep:
        result["sweep"] = sweep(cfg, args.sweep, nbytes)
    if args.gpu_path:
        from .gpu_path import gpu_path_costs

        result.update(gpu_path_costs(cfg, args.tensors, nbytes, args.rounds))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"hook CPU time per saved tensor ({args.tensor_kb} KiB, {args.tensors} tensors, calling thread, "
          f"median; each figure includes {timer_us:.2f} µs of timer):")
    print(f"  {'':<13} {'pack':>9} {'unpack':>9}   {'after gc.freeze (--manual-gc)':>30}")
    for key in pack:
        up = f"{unpack[key]:6.1f} µs" if key in unpack else f"{'-':>9}"
        upf = f"{unpack_frozen[key]:6.1f} µs" if key in unpack_frozen else f"{'-':>9}"
        print(f"  {key:<13} {pack[key]:6.1f} µs {up}   {pack_frozen[key]:11.1f} µs {upf}")
    print(f"  offload - keep, median over {args.rounds} rounds of keep, offload, offload, keep: "
          f"pack {gap['pack']:+.1f} µs, unpack {gap['unpack']:+.1f} µs")
    print("small GPT (8 layers, hidden 256, seq 256, 2 micro-batches of 4), policies alternating:")
    for p in ("keep", "offload"):
        print(f"  {p:<8} peak resident {mem[p]['peak_resident_bytes'] / 1e6:8.1f} MB   "
              f"median step {mem[p]['step_s']:.2f}s")
    print(f"  offload/keep: peak resident {peak_ratio:.2f}, step time {result['step_ratio_offload_vs_keep']:.2f}")
    if args.sweep:
        flat = result["sweep"]["flatness"]
        print(f"offload hooks at {args.sweep[-1]} vs {args.sweep[0]} tensors: pack x{flat['pack']:.2f}, "
              f"unpack x{flat['unpack']:.2f} (1.00 = flat)")
    if args.gpu_path:
        print("GPU data path's own Python (no-op streams, events and copies), per offloaded tensor:")
        for engine, p_us in result["gpu_path_pack_us"].items():
            calls = result["stream_calls_per_record"][engine]
            print(f"  {engine:<8} pack {p_us:6.1f} µs ({result['gpu_path_pack_us_gc_frozen'][engine]:.1f} after "
                  f"gc.freeze())  unpack {result['gpu_path_unpack_us'][engine]:6.1f} µs "
                  f"({result['gpu_path_unpack_us_gc_frozen'][engine]:.1f})  stream/event/copy calls per record: "
                  f"{calls['out']:.1f} out, {calls['back']:.1f} back")
    return 0
