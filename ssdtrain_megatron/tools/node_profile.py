"""`ssdtrain doctor --node-profile OUT.yaml`: the NodeProfile of this machine, measured.

The planner (plan/node.py) reads a node as a few figures per GPU; the built-in profiles take
them from datasheets. This module measures them where the job will run and writes them in the
same schema, so that ``--node OUT.yaml`` plans with this machine's own numbers:

* drives: each offload root on a distinct drive is one drive; its sequential O_DIRECT write and
  read GB/s come from io-bench's raw baseline (tools/iobench/measure.py ``raw_baseline``: several
  threads, 8 MiB requests, one preallocated file), in a private directory under the root that
  is removed after. Their median is the per-drive figure.
* host memory: three quarters of what the kernel reports available now (MemAvailable), shared
  by the GPUs: the rule a job applies at its start (plan/engine_choice.USABLE_FRACTION).
* the host memory bus (``host_memory_gbps``): one large host-memory copy on torch's threads,
  counted twice (it reads and writes every byte), a STREAM-copy-like lower bound of what the
  node's GPUs share (the channels' peak is higher).
* on a GPU: the pinned host<->device copy GB/s each way (the slower one is ``host_link_gbps``),
  a bf16 matmul's TFLOP/s, and with two GPUs or more the peer copy GB/s (``nvlink_gbps``).
* on a GPU, its kind (``gpu_kind``, from the device's name: :func:`kind_of_device`) and the
  GEMM sweep (``gemm_tflops_by_shape``: torch matmuls at Megatron layers' shapes, BF16 and FP8
  where the card runs it, a few seconds, the shapes of ``--config``'s job first;
  tools/gemm_sweep.py); on a CPU the sweep is skipped
  and ``source`` says why.
* the CPU optimizer (``cpu_adam_params_per_s``): torch's fused AdamW on the CPU, as
  megatron-core's optimizer CPU offload steps it, on the cores one local rank (one GPU) gets,
  bounded by the rank's share of the memory bus (tools/cpu_adam.py).
* on a CPU (no GPU): the training device is the CPU, and what stands in for each GPU figure is
  said in ``source``: its RAM for the GPU's memory, an fp32 matmul's TFLOP/s on torch's threads
  for ``gpu_tflops``, the host memory copy GB/s (what the memory tier's copies cost) for the
  host link, and the same for NVLink (one device: no tensor-parallel traffic).

What cannot be measured is said in ``source`` too: the drives' rated endurance (TBW) is taken as
one drive write per day for five years of the filesystem's size, a data-center drive's usual
rating; put the vendor's figure there.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..plan.engine_choice import USABLE_FRACTION
from ..plan.node import GB, NodeProfile
from .cpu_adam import describe as describe_cpu_adam
from .cpu_adam import measure_cpu_adam
from .gemm_sweep import job_shapes, measure_gemm_table

DRIVE_BYTES = 1 << 30
"""Bytes written and read per drive (less on a nearly full one: a quarter of its free space)."""
COPY_BYTES = 256 << 20
"""Bytes per host<->device (or host memory) copy measured."""
REPEATS = 5
ENDURANCE_DAYS = 5 * 365
"""Rated endurance assumed when none is known: one drive write per day for five years."""


def _say(text: str) -> None:
    print(f"[node-profile] {text}", file=sys.stderr, flush=True)


def _median_time(fn: Callable[[], None], repeats: int = REPEATS) -> float:
    fn()  # warm: first-touch page faults, kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- drives -----------------------------------------------------------------------------------


def measure_drives(roots: List[str], nbytes: Optional[int] = None) -> Dict[str, Any]:
    """One raw baseline per distinct drive among ``roots`` (usable directories): ``drives``,
    the median ``write_gbps`` and ``read_gbps``, ``tbw_tb`` (assumed, see the module
    docstring), ``direct`` (every drive took O_DIRECT) and ``per_drive`` (root, figures).

    Raises:
        RuntimeError: no root given.
    """
    from ..io.roots import drive_of
    from .iobench.measure import raw_baseline

    nbytes = nbytes or DRIVE_BYTES
    if not roots:
        raise RuntimeError("no usable offload root to measure a drive in: give --dir ROOT on the drive "
                           "activations will go to")
    seen: Dict[object, str] = {}
    for root in roots:
        seen.setdefault(drive_of(root)[0], root)
    per_drive = []
    for root in seen.values():
        free = shutil.disk_usage(root).free
        size = max(min(64 << 20, nbytes), min(nbytes, free // 4))
        work = tempfile.mkdtemp(prefix=".ssdtrain-node-profile-", dir=root)
        try:
            _say(f"drive under {root}: writing and reading {size / GB:.2f} GB (O_DIRECT, as io-bench's baseline)")
            got = raw_baseline(work, size)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        total = shutil.disk_usage(root).total
        per_drive.append({"root": root, "write_gbps": got["write_gbps"], "read_gbps": got["read_gbps"],
                          "direct": got["direct"], "bytes": total})
        _say(f"  write {got['write_gbps']:.2f} GB/s, read {got['read_gbps']:.2f} GB/s"
             + ("" if got["direct"] else " (O_DIRECT refused: buffered IO with fadvise)"))
    size_tb = statistics.median(d["bytes"] for d in per_drive) / 1e12
    return {"drives": len(per_drive),
            "write_gbps": statistics.median(d["write_gbps"] for d in per_drive),
            "read_gbps": statistics.median(d["read_gbps"] for d in per_drive),
            "tbw_tb": round(max(size_tb * ENDURANCE_DAYS, 1e-3), 3), "size_tb": size_tb,
            "direct": all(d["direct"] for d in per_drive), "per_drive": per_drive}


# -- host memory ------------------------------------------------------------------------------


def meminfo() -> Dict[str, int]:
    """MemTotal and MemAvailable from /proc/meminfo, bytes (empty where there is none)."""
    out: Dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


# -- compute and copies -----------------------------------------------------------------------


def matmul_tflops(device: str = "cpu", dtype_name: str = "float32", n: int = 1024) -> float:
    """TFLOP/s of an n x n matmul on ``device`` (2 n^3 FLOPs each)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def run() -> None:
        for _ in range(4):
            torch.mm(a, b)
        sync()

    return 4 * 2 * n ** 3 / _median_time(run) / 1e12


def host_copy_gbps(nbytes: Optional[int] = None) -> float:
    """GB/s of one host-memory copy of ``nbytes`` (default COPY_BYTES): what the memory tier's
    copies do on a CPU."""
    import torch

    nbytes = nbytes or COPY_BYTES
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    return nbytes / _median_time(lambda: dst.copy_(src)) / GB


def pinned_copy_gbps(device: int = 0, nbytes: int = COPY_BYTES) -> Tuple[float, float]:
    """(host->device, device->host) GB/s of pinned copies on GPU ``device``, one at a time."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    out = []
    for dst, src in ((dev, host), (host, dev)):
        def run(dst=dst, src=src) -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)

        out.append(nbytes / _median_time(run) / GB)
    return out[0], out[1]


def peer_copy_gbps(nbytes: int = COPY_BYTES) -> float:
    """GB/s of a device-to-device copy from GPU 0 to GPU 1 (NVLink where there is one)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")

    def run() -> None:
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    return nbytes / _median_time(run) / GB


def kind_of_device(name: str) -> Optional[str]:
    """The planner's GPU kind (plan/gpu_kind.py) of a CUDA device called ``name``, or None where
    its datasheet is not one of the kinds (an H100 PCIe or NVL, say)."""
    for needle, kind in (("GH200", "gh200"), ("H200", "h200"), ("B200", "b200"),
                         ("A100-SXM", "a100-sxm")):
        if needle in name:
            return kind
    if "H100" in name and "HBM3" in name:  # "NVIDIA H100 80GB HBM3": the SXM5 board
        return "h100-sxm"
    return None


def _compute_figures(first_shapes: Sequence[Tuple[int, int, int]] = ()) -> Tuple[Dict[str, Any], List[str]]:
    """The GPU figures (or what stands in for them on a CPU) and the words for ``source``."""
    import torch

    mem = meminfo()
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        prop = torch.cuda.get_device_properties(0)
        _say(f"{gpus} GPU(s), {prop.name}: bf16 matmul, pinned copies each way")
        tflops = matmul_tflops("cuda:0", "bfloat16", 8192)
        h2d, d2h = pinned_copy_gbps(0)
        notes = [f"GPU {prop.name}: bf16 matmul {tflops:.0f} TFLOP/s (an upper bound of what Megatron "
                 f"achieves), pinned copies {h2d:.1f} GB/s to and {d2h:.1f} GB/s from the GPU, one GPU "
                 "copying at a time"]
        if gpus > 1:
            nvlink = peer_copy_gbps()
            notes.append(f"GPU 0 -> 1 copy {nvlink:.1f} GB/s")
        else:
            nvlink = min(h2d, d2h)
            notes.append("one GPU: nvlink_gbps is the host link's figure (no tensor-parallel peer)")
        bus = 2 * host_copy_gbps()
        notes.append(_bus_note(bus))
        kind = kind_of_device(prop.name)
        notes.append(f"gpu_kind {kind} from the device name" if kind else
                     f"gpu_kind not set: {prop.name!r} is none of the planner's kinds (the table "
                     "below is read only with one: set gpu_kind by hand if its datasheet matches)")
        _say("GEMM sweep: torch matmuls at Megatron layers' shapes (a few seconds)")
        table, words = measure_gemm_table(first=first_shapes)
        notes.append(words)
        return {"gpus_per_node": gpus, "gpu_memory_bytes": int(prop.total_memory), "gpu_tflops": tflops,
                "host_link_gbps": min(h2d, d2h), "nvlink_gbps": nvlink, "host_memory_gbps": bus,
                "host_memory_total": mem.get("MemAvailable", 0), "gpu_kind": kind,
                "gemm_tflops_by_shape": table}, notes
    threads = torch.get_num_threads()
    _say(f"no GPU: the CPU stands in (fp32 matmul on {threads} thread(s), host memory copies)")
    tflops = matmul_tflops("cpu", "float32", 1024)
    copy = host_copy_gbps()
    total = mem.get("MemTotal", 0)
    notes = [f"no GPU, the CPU trains: gpu_memory_bytes is its RAM, gpu_tflops an fp32 matmul on {threads} "
             f"torch thread(s) ({tflops:.3f} TFLOP/s), host_link_gbps and nvlink_gbps the host memory "
             f"copy ({copy:.1f} GB/s: what the memory tier's copies cost here)", _bus_note(2 * copy)]
    _table, skipped = measure_gemm_table()
    _say(skipped)
    notes.append(skipped)
    return {"gpus_per_node": 1, "gpu_memory_bytes": max(total, GB), "gpu_tflops": tflops,
            "host_link_gbps": copy, "nvlink_gbps": copy, "host_memory_gbps": 2 * copy,
            "host_memory_total": mem.get("MemAvailable", 0)}, notes


def _bus_note(bus: float) -> str:
    import torch

    return (f"host_memory_gbps {bus:.1f}: one host-memory copy on {torch.get_num_threads()} torch "
            "thread(s), reads and writes counted (a lower bound of the memory channels' peak)")


def host_memory_per_gpu(available: int, gpus: int) -> int:
    """Host memory one GPU may fill: the job's rule (plan/engine_choice.USABLE_FRACTION of what
    is free, shared by the node's GPUs), so a measured profile and a job agree."""
    return int(available * USABLE_FRACTION) // max(gpus, 1)


def measure_node(roots: List[str], name: Optional[str] = None, drive_bytes: Optional[int] = None,
                 gemm_shapes: Sequence[Tuple[int, int, int]] = ()) -> NodeProfile:
    """This machine's NodeProfile, measured (see the module docstring); progress on stderr.
    ``gemm_shapes``: the job's GEMMs, swept before the usual ones (tools/gemm_sweep.py)."""
    compute, notes = _compute_figures(gemm_shapes)
    drives = measure_drives(roots, drive_bytes)
    gpus = compute["gpus_per_node"]
    host = host_memory_per_gpu(compute.pop("host_memory_total"), gpus)
    notes.append(f"host memory: {USABLE_FRACTION:g} x MemAvailable / {gpus} GPU(s) at measurement "
                 "(the job's rule: docs/models.md, Host memory and the link)")
    notes.append(f"{drives['drives']} drive(s) (offload roots on distinct drives: "
                 + ", ".join(d["root"] for d in drives["per_drive"]) + "), io-bench's O_DIRECT baseline"
                 + ("" if drives["direct"] else " (O_DIRECT refused: buffered IO)"))
    notes.append(f"drive_tbw_tb ASSUMED, not measured: 1 drive write per day for 5 years of "
                 f"{drives['size_tb']:.2f} TB; put the vendor's rated TBW here")
    adam = measure_cpu_adam(gpus, compute["host_memory_gbps"])
    notes.append(describe_cpu_adam(adam, gpus))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    host_name = socket.gethostname()
    return NodeProfile(
        name=name or f"measured-{host_name}", gpus_per_node=gpus,
        gpu_memory_bytes=int(compute["gpu_memory_bytes"]), gpu_tflops=round(compute["gpu_tflops"], 4),
        host_memory_bytes=int(host), host_link_gbps=round(compute["host_link_gbps"], 3),
        drives=drives["drives"], drive_write_gbps=round(drives["write_gbps"], 3),
        drive_read_gbps=round(drives["read_gbps"], 3), drive_tbw_tb=drives["tbw_tb"],
        nvlink_gbps=round(compute["nvlink_gbps"], 3),
        host_memory_gbps=round(compute["host_memory_gbps"], 3),
        cpu_adam_params_per_s=float(f"{adam['params_per_s']:.4g}"),
        gpu_kind=compute.get("gpu_kind"), gemm_tflops_by_shape=compute.get("gemm_tflops_by_shape"),
        source=f"measured by ssdtrain doctor --node-profile on {host_name}, {when}; " + "; ".join(notes))


def write_node_profile(path: str, report: Dict[str, Any], preset: Optional[str] = None) -> int:
    """Measure this machine into ``path`` (YAML), from the roots doctor found usable in
    ``report``; say what was written on stderr (stdout is doctor's report, one JSON object
    with --json). ``preset``: doctor's --config, whose job's GEMM shapes the sweep measures
    first. 1 (and why) when nothing could be measured."""
    roots = [r["root"] for r in report["roots"] if r["problem"] is None and r["writable"]]
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        print(f"ssdtrain doctor: --node-profile {path}: the folder {parent} does not exist", file=sys.stderr)
        return 1
    if not roots:  # before a minute of measuring the rest
        print("ssdtrain doctor: --node-profile: no usable offload root to measure a drive in: give --dir "
              "ROOT on the drive activations will go to", file=sys.stderr)
        return 1
    try:
        shapes = job_shapes(preset) if preset else []
    except ValueError as exc:
        print(f"ssdtrain doctor: --node-profile with --config {preset}: {exc}", file=sys.stderr)
        return 1
    try:
        profile = measure_node(roots, gemm_shapes=shapes)
    except (RuntimeError, OSError) as exc:
        print(f"ssdtrain doctor: --node-profile: {exc}", file=sys.stderr)
        return 1
    profile.save(path)
    _say(f"written to {path}: {profile.describe()}")
    return 0
