#!/usr/bin/env python3
"""`make gpu-check`: the one prepared check of the GPU data path, for a bare single-GPU box.

The box: its own python3 (3.12) and a CUDA 13 build of torch (2.11 or newer), cupy,
nvidia-cufile and pytest; no network. Everything else comes as wheels in ``.whl/`` (gitignored):
megatron-core 0.16.1 (cp312), kvikio-cu13 and libkvikio-cu13 26.10 (required), and whatever
else is there (rapids-logger, cuda-pathfinder: libkvikio imports them). Within about 8 minutes the
check runs, each step in its own process under its own timeout (a hung step is reported, the
others still run), writing results as it goes:

  env          python, torch, CUDA, the GPU, free disk under the scratch directory
  wheels       the wheels in --wheels are the ones expected
  install      the wheels and this project (--no-deps, --no-index) into a private directory
  bitwise-*    megatron-core GPT in bf16, keep vs offload, per engine (posix, memory, tiered,
               gds; aio last, if its op builds): losses and gradients bitwise equal
  stress       100 steps, compute on a non-default stream, megatron's split QKV (compact
               views) offloaded: losses and gradients bitwise equal at every step
  cuda-tests   the pytest tests marked `cuda`
  syncs        host synchronisations on the training thread (torch.cuda.set_sync_debug_mode),
               steady state, offload with the memory engine vs keep
  io-bench     the drive's bandwidth through the posix engine (ssdtrain io-bench)
  measure      16 layers, hidden 4096, seq 2048 (--layers/--hidden/--seq): peak
               max_memory_allocated, step time, tokens/s for keep, offload (memory, posix)
               and full recompute at micro-batch K (--micro-batch, 2), and for keep, full
               recompute, adaptive and offload at K+1 inside a memory budget that fits keep
               at K but not at K+1

It writes ``gpu-check.json`` (everything) and ``table.txt`` (the target rows, PASS/FAIL) into
--out, after every step. ``GPU_CHECK_DRY=1`` (or --dry-run) runs what needs no GPU: argument
parsing, the wheel check and the plan.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = {
    "megatron-core": r"megatron_core-0\.16\.1-.*cp312.*\.whl$",
    "kvikio-cu13": r"kvikio_cu13-26\.10.*\.whl$",
    "libkvikio-cu13": r"libkvikio_cu13-26\.10.*\.whl$",
}
# (name, timeout seconds, what it does). Order = priority: what matters most runs first.
STEPS = [
    ("env", 40, "python, torch, CUDA and GPU versions; free disk"),
    ("install", 90, "pip install --no-deps --no-index the wheels and this project"),
    ("bitwise-posix", 60, "GPT bf16, keep vs offload (posix): losses and grads bitwise"),
    ("bitwise-memory", 60, "GPT bf16, keep vs offload (memory): losses and grads bitwise"),
    ("bitwise-tiered", 60, "GPT bf16, keep vs offload (tiered, small memory tier): bitwise"),
    ("bitwise-gds", 60, "GPT bf16, keep vs offload (gds, kvikio): bitwise"),
    ("stress", 90, "100 steps, non-default compute stream, compact views: bitwise every step"),
    ("cuda-tests", 120, "pytest -m cuda"),
    ("syncs", 60, "host syncs on the training thread, offload (memory) vs keep"),
    ("io-bench", 60, "the drive's write/read bandwidth through the posix engine"),
    ("measure", 240, "peak memory, step time, tokens/s: keep, offload, adaptive, recompute"),
    ("bitwise-aio", 90, "GPT bf16, keep vs offload (aio), if DeepSpeed's aio op builds"),
]
TOTAL_S = 470  # the whole check stays under 8 minutes
CHILD_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1", "NCCL_P2P_DISABLE": "1"}


# -- the parent: plan, run the steps, report ------------------------------------------------

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-check-results", help="results directory (default: %(default)s)")
    p.add_argument("--wheels", default=".whl", help="folder of the wheels to install (default: %(default)s)")
    p.add_argument("--scratch", default=None,
                   help="directory on the drive to offload to (default: <out>/scratch)")
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY", "") not in ("", "0"),
                   help="only what needs no GPU: arguments, wheels, the plan (also GPU_CHECK_DRY=1)")
    p.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    p.add_argument("--total-s", type=_positive_int, default=TOTAL_S,
                   help="time limit of the whole check, seconds (default: %(default)s)")
    p.add_argument("--layers", type=_positive_int, default=16, help="measure: layers (default: %(default)s)")
    p.add_argument("--hidden", type=_positive_int, default=4096, help="measure: hidden size (default: %(default)s)")
    p.add_argument("--heads", type=_positive_int, default=32, help="measure: attention heads (default: %(default)s)")
    p.add_argument("--seq", type=_positive_int, default=2048, help="measure: sequence length (default: %(default)s)")
    p.add_argument("--vocab", type=_positive_int, default=8192, help="measure: vocabulary (default: %(default)s)")
    p.add_argument("--micro-batch", type=_positive_int, default=2,
                   help="measure: micro-batch K compared side by side; K+1 then runs in a budget keep "
                        "cannot fit (default: %(default)s)")
    p.add_argument("--steps", type=_positive_int, default=2, help="measure: timed steps per point (default: %(default)s)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [s[0] for s in STEPS]
    if args.only:
        bad = [n for n in args.only.split(",") if n not in names]
        if bad:
            p.error(f"--only: unknown step(s) {', '.join(bad)}; steps: {', '.join(names)}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    args.out = os.path.abspath(args.out)
    args.wheels = os.path.abspath(args.wheels)
    args.scratch = os.path.abspath(args.scratch or os.path.join(args.out, "scratch"))
    return args


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def check_wheels(folder: str) -> Dict[str, dict]:
    """Per expected wheel: the file found, or what is missing."""
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(folder, "*.whl")))
    out = {}
    for name, pattern in WHEELS.items():
        hits = [f for f in files if re.search(pattern, f)]
        out[name] = {"ok": bool(hits), "file": hits[0] if hits else None,
                     "expected": pattern, "folder": folder}
    return out


def plan(args: argparse.Namespace) -> List[dict]:
    only = set(args.only.split(",")) if args.only else None
    return [{"step": n, "timeout_s": t, "what": w} for n, t, w in STEPS if only is None or n in only]


class Results:
    """gpu-check.json and table.txt in --out, rewritten after every step."""

    def __init__(self, out: str, header: dict) -> None:
        self.out = out
        self.data = {"header": header, "steps": {}, "targets": []}
        os.makedirs(out, exist_ok=True)

    def step(self, name: str, result: dict) -> None:
        self.data["steps"][name] = result
        self.data["targets"] = targets(self.data["steps"])
        self.write()

    def write(self) -> None:
        tmp = os.path.join(self.out, "gpu-check.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.out, "gpu-check.json"))
        with open(os.path.join(self.out, "table.txt"), "w") as f:
            f.write(render(self.data) + "\n")


def run_parent(args: argparse.Namespace) -> int:
    start = time.monotonic()
    wheels = check_wheels(args.wheels)
    steps = plan(args)
    header = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
              "dry_run": args.dry_run, "out": args.out, "scratch": args.scratch, "wheels": wheels,
              "plan": steps, "total_s": args.total_s,
              "measure_shape": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch", "steps")}}
    res = Results(args.out, header)
    say = lambda msg: print(f"gpu-check: {msg}", flush=True)  # noqa: E731
    for name, w in wheels.items():
        say(f"wheel {name}: {w['file'] or 'MISSING (expected ' + w['expected'] + ' in ' + args.wheels + ')'}")
    if sys.version_info[:2] != (3, 12):
        say(f"note: python {sys.version.split()[0]}; the wheels carried are for 3.12 (cp312)")
    if args.dry_run:
        say(f"dry run: would run {len(steps)} steps within {args.total_s}s, results in {args.out}:")
        for s in steps:
            say(f"  {s['step']:<15} timeout {s['timeout_s']:>4}s  {s['what']}")
        res.data["steps"]["wheels"] = {"status": "pass" if all(w["ok"] for w in wheels.values()) else "fail",
                                       "wheels": wheels}
        res.write()
        say(f"dry run done; plan written to {os.path.join(args.out, 'gpu-check.json')}")
        return 0
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    site = os.path.join(args.out, "site")
    res.step("wheels", {"status": "pass" if all(w["ok"] for w in wheels.values()) else "fail", "wheels": wheels})
    env = dict(os.environ, **CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join([REPO, site] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env["TORCH_EXTENSIONS_DIR"] = env.get("TORCH_EXTENSIONS_DIR", os.path.join(args.out, "torch_extensions"))
    for s in steps:
        name, timeout = s["step"], s["timeout_s"]
        left = args.total_s - (time.monotonic() - start) - 5
        if left < 15:
            say(f"{name}: not run, out of time")
            res.step(name, {"status": "not run", "why": f"out of time ({args.total_s}s for the whole check)"})
            continue
        limit = int(min(timeout, left))
        say(f"{name}: running (timeout {limit}s) ...")
        t0 = time.monotonic()
        if name == "install":
            result = install(args, site, env, limit)
        else:
            result = run_child(args, name, env, limit)
        result["seconds"] = round(time.monotonic() - t0, 1)
        res.step(name, result)
        say(f"{name}: {result['status']} ({result['seconds']}s){' - ' + result['why'] if result.get('why') else ''}")
        if name == "env" and result["status"] != "pass":
            say("the environment is not usable; stopping")
            break
    print(render(res.data), flush=True)
    shutil.rmtree(args.scratch, ignore_errors=True)
    failed = [t for t in res.data["targets"] if t["result"] == "FAIL"]
    say(f"results in {args.out}/gpu-check.json and table.txt; {len(failed)} target(s) FAIL")
    return 1 if failed else 0


def install(args: argparse.Namespace, site: str, env: dict, limit: int) -> dict:
    log_path = os.path.join(args.out, "logs", "install.log")
    wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    cmds = []
    if wheels:
        cmds.append([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--upgrade",
                     "--target", site] + wheels)
    # The project from this checkout; the tests and the steps import it from the checkout
    # (first on PYTHONPATH), so a failure here is reported but does not stop the check.
    project = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
               "--target", os.path.join(args.out, "site-project"), REPO]
    out = {"status": "pass", "commands": []}
    deadline = time.monotonic() + limit
    with open(log_path, "w") as log:
        for cmd in cmds + [project]:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    timeout=max(1, deadline - time.monotonic())).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            out["commands"].append({"cmd": " ".join(cmd[:8]) + " ...", "rc": rc})
            if rc != 0 and cmd is not project:
                out["status"] = "fail"
                out["why"] = f"installing the wheels failed (rc {rc}); see {log_path}"
            elif rc != 0:
                out["project_install"] = f"failed (rc {rc}); the checkout is used from PYTHONPATH"
    check = subprocess.run([sys.executable, "-c", "import megatron.core, ssdtrain_megatron; print(megatron.core.__version__)"],
                           env=env, capture_output=True, text=True, timeout=60)
    out["megatron_core"] = check.stdout.strip() or check.stderr.strip()[-500:]
    if check.returncode != 0:
        out["status"] = "fail"
        out["why"] = f"import megatron.core failed: {check.stderr.strip().splitlines()[-1:] }"
    return out


def run_child(args: argparse.Namespace, name: str, env: dict, limit: int) -> dict:
    result_path = os.path.join(args.out, "steps", f"{name}.json")
    os.makedirs(os.path.dirname(result_path), exist_ok=True)
    if os.path.exists(result_path):
        os.unlink(result_path)
    log_path = os.path.join(args.out, "logs", f"{name}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--out", args.out,
           "--scratch", args.scratch] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch", "steps")]
    child_env = dict(env, GPU_CHECK_DEADLINE=str(time.time() + limit - 3))
    with open(log_path, "w") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
    partial = _load(result_path)
    if rc is None:
        out = dict(partial or {}, status="timeout", why=f"killed after {limit}s; see {log_path}")
    elif partial is None:
        out = {"status": "error", "why": f"exit status {rc}, no result; see {log_path}: {_tail(log_path)}"}
    else:
        out = partial
        if rc != 0 and out.get("status") == "pass":
            out["status"] = "error"
            out["why"] = f"exit status {rc}: {_tail(log_path)}"
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=5)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _load(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-n:])
    except OSError:
        return ""


# -- targets and the table ------------------------------------------------------------------

def targets(steps: Dict[str, dict]) -> List[dict]:
    rows: List[dict] = []

    def row(name: str, ok: Optional[bool], detail: str) -> None:
        rows.append({"target": name, "result": "n/a" if ok is None else ("PASS" if ok else "FAIL"), "detail": detail})

    for name, st in steps.items():
        if name.startswith("bitwise-") or name in ("stress", "cuda-tests"):
            status = st.get("status")
            ok = True if status == "pass" else (None if status in ("skip", "not run") else False)
            row(f"{name}: bitwise / tests", ok, st.get("why") or st.get("summary", ""))
    sy = steps.get("syncs", {})
    if sy.get("status") in ("pass", "fail"):
        row("no host sync added (memory engine, steady state)", sy["offload_syncs"] <= sy["keep_syncs"],
            f"syncs per step: offload {sy['offload_syncs']}, keep {sy['keep_syncs']}")
    me = steps.get("measure", {})
    k = me.get("micro_batch", 1)
    pts = {p["name"]: p for p in me.get("points", []) if p.get("ok")}
    keep = pts.get(f"keep@{k}")
    for eng in ("memory", "posix"):
        off = pts.get(f"offload-{eng}@{k}")
        if keep and off:
            ratio = off["peak_bytes"] / keep["peak_bytes"]
            row(f"peak offload-{eng} <= 0.5x keep (micro-batch {k})", ratio <= 0.5,
                f"{ratio:.2f}x ({off['peak_bytes'] / 2**30:.1f} vs {keep['peak_bytes'] / 2**30:.1f} GiB; "
                f"activations alone {_activation_ratio(off, keep):.2f}x)")
            bw = me.get("bandwidth", {}).get(eng)
            if bw:
                link = off["bytes_written"] / bw["write"] + off["bytes_read"] / bw["read"]
                bound = max(keep["step_s"], link)
                r = off["step_s"] / bound
                row(f"overlap offload-{eng} <= 1.05x max(keep, bytes/bw)", r <= 1.05,
                    f"{off['step_s']:.3f}s vs bound {bound:.3f}s (keep {keep['step_s']:.3f}s, link {link:.3f}s) = {r:.2f}x")
    ad, rc = pts.get(f"adaptive@{k + 1}"), pts.get(f"recompute@{k + 1}")
    keep_more = next((p for p in me.get("points", []) if p["name"] == f"keep@{k + 1}"), None)
    if ad and keep and rc:
        premise = keep_more is not None and keep_more.get("oom")
        ok = ad["tokens_per_s"] >= keep["tokens_per_s"] and ad["tokens_per_s"] > rc["tokens_per_s"]
        row(f"ROK: adaptive@{k + 1} >= keep's best and > recompute (in budget)", ok if premise else None,
            f"tokens/s adaptive {ad['tokens_per_s']:.0f}, keep@{k} {keep['tokens_per_s']:.0f}, recompute@{k + 1} "
            f"{rc['tokens_per_s']:.0f}" + ("" if premise else f"; keep fit at {k + 1} in the budget: not the ROK regime"))
    return rows


def _activation_ratio(off: dict, keep: dict) -> float:
    """Peak above what stays resident between steps, offload over keep."""
    base = keep.get("resident_after_step", 0)
    return max(off["peak_bytes"] - base, 0) / max(keep["peak_bytes"] - base, 1)


def render(data: dict) -> str:
    lines = ["target                                                  result  detail"]
    for t in data.get("targets", []):
        lines.append(f"{t['target'][:55]:<55} {t['result']:>6}  {t['detail']}")
    me = data.get("steps", {}).get("measure", {})
    if me.get("points"):
        lines.append("")
        lines.append(f"{'point':<20}{'peak GiB':>9}{'step s':>9}{'tokens/s':>10}{'written GB':>11}{'read GB':>9}")
        for p in me["points"]:
            if p.get("ok"):
                lines.append(f"{p['name']:<20}{p['peak_bytes'] / 2**30:>9.2f}{p['step_s']:>9.3f}{p['tokens_per_s']:>10.0f}"
                             f"{p['bytes_written'] / 1e9:>11.2f}{p['bytes_read'] / 1e9:>9.2f}")
            else:
                lines.append(f"{p['name']:<20}  {'out of memory' if p.get('oom') else p.get('error', 'failed')}")
    lines.append("")
    for name, st in data.get("steps", {}).items():
        lines.append(f"step {name:<15} {st.get('status', '?'):<8} {st.get('seconds', '')}")
    return "\n".join(lines)


# -- the children: one step each, in their own process --------------------------------------

def child(args: argparse.Namespace) -> int:
    path = os.path.join(args.out, "steps", f"{args.child}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def save(result: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, path)

    from gpu_check_steps import run_step  # scripts/gpu_check_steps.py: imports torch

    try:
        result = run_step(args, save)
    except BaseException as exc:  # noqa: BLE001 - reported in the result, and the exit status
        import traceback

        traceback.print_exc()
        save({"status": "error", "why": f"{type(exc).__name__}: {exc}"[:2000]})
        return 1
    save(result)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        return child(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
