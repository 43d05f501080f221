"""`ssdtrain doctor`: what this machine can do for SSD activation offloading, and why not.

One report, read-only (it writes one probe file per offload root and removes it): Python,
torch and its CUDA build, the GPUs, megatron-core (and Transformer Engine, Apex, DeepSpeed),
each IO engine (available, or what it is missing), the checksum, every offload root (its
filesystem, device, free space, whether it takes O_DIRECT writes; "missing" or "not a
directory" as the offloader would refuse it, and a warning for a root on the filesystem of /
or two roots on one drive, from the offloader's own checks in io/roots.py), the NVMe drives
the kernel sees, host memory and the pinned-memory limit (``ulimit -l``). A root is the part of
a dirs template above its first {job} component.

Exit status 0 when the default engine (posix) can write into every root; 1 otherwise (a
missing root, or one that is not a directory, included).

``--preflight`` checks instead what the launcher checks in each worker before Megatron starts,
for every local rank of this node (tools/preflight_cli.py, megatron/preflight.py): the launch
scripts run it on each node before torchrun. Nothing is printed when the node passes; a
failing node prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
from typing import Any, Dict, List, Optional

from ..io.where import binary as gib
from .cli_types import PRESET_HELP, preset_arg
from .preflight_cli import add_preflight_args, run_preflight
from ..io.where import filesystem_of

ENGINES = ("posix", "aio", "gds", "memory", "tiered")


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="report torch/CUDA, megatron-core, engines, drives, "
                                             "free space and limits on this machine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", action="append", default=None, metavar="ROOT",
                   help="offload root to check (repeatable; default: the roots of --config, else "
                        "OffloadConfig's default /tmp/ssdtrain)")
    p.add_argument("--config", metavar="PRESET", type=preset_arg,
                   help=f"{PRESET_HELP}: check its offload: dirs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--node-profile", metavar="OUT.yaml", default=None,
                   help="also measure this machine (each --dir's drive, free host memory, "
                        "on a GPU its pinned copies and matmul and a GEMM sweep at Megatron "
                        "layers' shapes, --config's job's first (gemm_tflops_by_shape), on a CPU "
                        "what stands in for them, "
                        "torch's fused AdamW on the cores one local rank gets) and "
                        "write its node profile there, for `ssdtrain plan --node OUT.yaml` "
                        "(tools/node_profile.py; about a minute)")
    add_preflight_args(p)
    p.set_defaults(func=run_doctor)
    return p


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_report() -> Dict[str, Any]:
    import torch

    out: Dict[str, Any] = {"version": torch.__version__, "cuda_build": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "gpus": []}
    if out["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            out["gpus"].append({"index": i, "name": prop.name, "memory_bytes": prop.total_memory})
    return out


MEGATRON_DEEPSPEED_DEEPSPEED = "0.19.0"
"""The DeepSpeed release Megatron-DeepSpeed (master 4efb479d) trains with (setup.py's
``megatron-deepspeed`` extra; tests/test_megatron_deepspeed_pretrain.py)."""


def packages_report() -> Dict[str, Any]:
    return {
        "megatron-core": _version("megatron-core"),
        "transformer-engine": _version("transformer-engine") or _version("transformer_engine"),
        "apex": "installed" if importlib.util.find_spec("apex") is not None else None,
        "deepspeed": _version("deepspeed"),
        "kvikio": _version("kvikio-cu12") or _version("kvikio-cu13") or _version("kvikio"),
        "tqdm": _version("tqdm"),
        "crc32c": _version("crc32c"),
    }


def engines_report() -> Dict[str, Dict[str, Any]]:
    from ..io import engine_class

    out = {}
    for name in ENGINES:
        try:
            ok, why = engine_class(name).is_available()
        except Exception as exc:  # noqa: BLE001 - a probe that fails is a reason too
            ok, why = False, f"{type(exc).__name__}: {exc}"
        out[name] = {"available": bool(ok), "why_not": None if ok else why}
    return out


def root_report(root: str) -> Dict[str, Any]:
    """A root as the offloader would check it (io/roots.py ``root_problem``): ``problem`` is
    None, "missing", "not a directory" or another reason; for a usable root also its
    filesystem, device, free space and whether it takes O_DIRECT writes."""
    import tempfile

    from ..io.roots import root_problem

    problem = root_problem(root)
    out: Dict[str, Any] = {"root": root, "exists": os.path.isdir(root), "problem": problem,
                           "writable": False, "o_direct": False, "free_bytes": None, "total_bytes": None}
    fs, dev = filesystem_of(root)
    out["filesystem"], out["device"] = fs, dev
    if problem is not None:
        out["notes"] = []
        return out
    try:
        st = os.statvfs(root)
        out["free_bytes"], out["total_bytes"] = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError as exc:
        out["error"] = exc.strerror or str(exc)
    try:
        fd, path = tempfile.mkstemp(prefix=".ssdtrain-doctor-", dir=root)
    except OSError as exc:
        out["error"] = f"cannot write there: {exc.strerror or exc}"
        return _root_notes(out)
    try:
        out["writable"] = True
        try:
            os.close(os.open(path, os.O_RDWR | os.O_DIRECT))
            out["o_direct"] = True
        except (OSError, AttributeError):
            pass
    finally:
        os.close(fd)
        os.unlink(path)
    return _root_notes(out)


def _root_notes(out: Dict[str, Any]) -> Dict[str, Any]:
    from ..io.where import filesystem_notes

    notes = filesystem_notes(out["filesystem"])
    if out["writable"] and not out["o_direct"]:
        notes.append("refuses O_DIRECT: reads may come from the page cache")
    out["notes"] = notes
    return out


def nvme_drives() -> List[Dict[str, Any]]:
    """NVMe block devices the kernel lists in /sys/block (Linux)."""
    drives = []
    try:
        names = sorted(n for n in os.listdir("/sys/block") if n.startswith("nvme"))
    except OSError:
        return drives
    for name in names:
        base = f"/sys/block/{name}"
        try:
            with open(f"{base}/size", encoding="ascii") as fh:
                size = int(fh.read()) * 512
        except (OSError, ValueError):
            size = None
        model = None
        try:
            with open(f"{base}/device/model", encoding="utf-8") as fh:
                model = fh.read().strip()
        except OSError:
            pass
        drives.append({"device": f"/dev/{name}", "bytes": size, "model": model})
    return drives


def memory_report() -> Dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    total = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
    except OSError:
        pass
    from ..config import OffloadConfig

    return {"host_memory_bytes": total, "cpus": os.cpu_count(),
            "memlock_soft": None if soft == resource.RLIM_INFINITY else soft,
            "memlock_hard": None if hard == resource.RLIM_INFINITY else hard,
            "staging_default_bytes": OffloadConfig().staging_bytes()}


def _roots(args: argparse.Namespace) -> List[str]:
    from ..config import OffloadConfig
    from ..io.layout import Identity
    from ..io.roots import root_of

    if args.dir:
        templates = list(args.dir)
    elif args.config:
        templates = list(OffloadConfig.from_yaml(args.config).dirs)
    else:
        templates = list(OffloadConfig().dirs)
    ident = Identity.detect(OffloadConfig().job_id())
    return [os.path.abspath(root_of(t, ident)) for t in templates]


def build_report(args: argparse.Namespace) -> Dict[str, Any]:
    from .. import __version__
    from ..io.checksum import describe
    from ..io.roots import root_warnings

    roots = [root_report(r) for r in _roots(args)]
    return {
        "ssdtrain": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch_report(),
        "packages": packages_report(),
        "engines": engines_report(),
        "checksum": describe(),
        "roots": roots,
        "root_warnings": root_warnings([r["root"] for r in roots if r["problem"] is None]),
        "nvme_drives": nvme_drives(),
        "memory": memory_report(),
    }


def _limit(n: Optional[int]) -> str:
    return "unlimited" if n is None else gib(n)


def render(r: Dict[str, Any]) -> str:
    t, pk = r["torch"], r["packages"]
    lines = [f"ssdtrain {r['ssdtrain']} on Python {r['python']} ({r['platform']})"]
    cuda = (f"CUDA {t['cuda_build']} build, " if t["cuda_build"] else "CPU build, ") + \
        (f"{len(t['gpus'])} GPU(s): " + ", ".join(f"{g['name']} {gib(g['memory_bytes'])}" for g in t["gpus"])
         if t["cuda_available"] else "no GPU visible (the demo and bench run on the CPU)")
    lines.append(f"{'torch':<18} {t['version']}, {cuda}")
    from ..megatron.compat import SUPPORTED_MEGATRON_CORE

    mc = pk["megatron-core"]
    tested = ", ".join(f"{v}.x" for v in SUPPORTED_MEGATRON_CORE)
    lines.append(f"{'megatron-core':<18} " + (f"{mc}" + ("" if mc.rsplit(".", 1)[0] in SUPPORTED_MEGATRON_CORE else
                                                   f" (install() supports {tested}; it will refuse this one)")
                                      if mc else "not installed (pip install 'ssdtrain-megatron[megatron]')"))
    for name in ("transformer-engine", "apex", "deepspeed", "kvikio"):
        note = ""
        if name == "deepspeed" and pk[name] and pk[name] != MEGATRON_DEEPSPEED_DEEPSPEED:
            note = (f" (Megatron-DeepSpeed 4efb479d needs DeepSpeed {MEGATRON_DEEPSPEED_DEEPSPEED}: "
                    "its training.py imports deepspeed.compression.compress, gone in 0.19.8; "
                    "pip install 'ssdtrain-megatron[megatron-deepspeed]')")
        lines.append(f"{name:<18} {pk[name] or 'not installed'}{note}")
    lines.append("engines:")
    for name, e in r["engines"].items():
        lines.append(f"  {name:<8} " + ("available" if e["available"] else f"unavailable: {e['why_not']}"))
    lines.append(f"{'checksum':<18} {r['checksum']}")
    lines.append("offload roots:")
    for root in r["roots"]:
        if root["problem"] is not None:
            lines.append(f"  {root['root']}: {root['problem']}" + (
                " (mount the drive or create it; the offloader refuses a missing root unless "
                "create_dirs)" if root["problem"] == "missing" else ""))
            continue
        where = root["root"]
        free = (f"{gib(root['free_bytes'])} free of {gib(root['total_bytes'])}"
                if root.get("free_bytes") is not None else "free space unknown")
        state = "writable" if root["writable"] else f"NOT WRITABLE ({root.get('error', '')})"
        direct = ", O_DIRECT" if root["o_direct"] else ""
        lines.append(f"  {where}: {free} on {root['filesystem']} ({root['device']}), {state}{direct}")
        for note in root["notes"]:
            lines.append(f"    note: {note}")
    lines += [f"  warning: {w}" for w in r["root_warnings"]]
    drives = r["nvme_drives"]
    lines.append(f"{'NVMe drives':<18} " + (", ".join(f"{d['device']} {gib(d['bytes']) if d['bytes'] else '?'}"
                                                 + (f" {d['model']}" if d["model"] else "") for d in drives)
                                      if drives else "none listed in /sys/block"))
    m = r["memory"]
    lines.append(f"{'host memory':<18} {gib(m['host_memory_bytes']) if m['host_memory_bytes'] else '?'}, "
                 f"{m['cpus']} CPUs")
    lines.append(f"{'pinned memory':<18} ulimit -l {_limit(m['memlock_soft'])} (hard {_limit(m['memlock_hard'])})"
                 + ("" if m["memlock_soft"] is None else
                    "; the aio engine and pinned host pools need more: ulimit -l unlimited"))
    lines.append(f"{'pinned staging':<18} {gib(m['staging_default_bytes'])} per rank by default (2 x max_inflight_bytes; "
                 "on a GPU a drive engine's writes wait there for the drive, not in GPU memory): "
                 "`ssdtrain plan --config PRESET` says what a job needs (pinned staging per GPU; "
                 "--ssd-offload-pinned-staging-bytes)")
    return "\n".join(lines)


def run_doctor(args: argparse.Namespace) -> int:
    if args.preflight:
        return run_preflight(args)
    if args.launch_args:
        from .cli_types import UsageError

        raise UsageError("arguments after -- are the launcher's, checked by --preflight: add it")
    report = build_report(args)
    print(json.dumps(report, indent=1) if args.json else render(report))
    ok = report["engines"]["posix"]["available"] and all(r["writable"] for r in report["roots"])
    if args.node_profile:
        from .node_profile import write_node_profile

        ok = write_node_profile(args.node_profile, report, args.config) == 0 and ok
    return 0 if ok else 1
