#!/usr/bin/env python3
"""`make gpu-check`: the one prepared check of the GPU data path, for a bare single-GPU box.

The box: its own python3 (3.12) and a CUDA 13 build of torch (2.11), cupy and nvidia-cufile; no
network. Everything else comes as wheels in ``.whl/`` (gitignored), made by ``make gpu-bundle``
(gpu_bundle.py) where there is network. Each step runs in its own process under its own
time limit (a hung step is reported, the others still run); the limits add up to at most 480 s
of the run's 490, and each step's estimate (start, pinning its pools, collecting tests, its work) fits its limit
(gpu_check_plan.py):

  env          python, torch, CUDA, the GPU, free disk (no GPU: nothing else runs)
  install      pip install --no-index --find-links .whl --prefix <out>/prefix: what the box lacks
  imports      megatron.core (0.16.1) and kvikio (the mode it prefers), and whether the gds engine runs
  bitwise-*    megatron-core GPT in bf16, keep vs keep vs offload, per engine (posix, memory, tiered,
               gds through GPUDirect Storage, gds in kvikio's compat mode), the compute stream
               delayed (torch.cuda._sleep) before every layer's forward and backward, so a missing
               wait shows up as wrong bytes: losses and gradients bitwise equal at every step
  stress       50 steps, compute on a non-default stream (delayed too), megatron's split QKV
               (compact views) offloaded: bitwise equal at every step
  cuda-tests   the cuda-marked tests this box can run, each required to pass (gpu_check_cuda.py)
  syncs        host synchronisations on the training thread (torch.cuda.set_sync_debug_mode),
               steady state, offload with the memory engine vs keep
  optimizer-offload  megatron-core's optimizer CPU offload (HybridDeviceOptimizer, half the parameters)
               with ours through the launcher, against it alone: pools, pinned memory, bitwise,
               the optimizer step vs the plan (gpu_check_optimizer.py; NOT RUN without Transformer Engine)
  measure      8 layers, hidden 2048, seq 1024 (--layers/--hidden/--seq; sized to finish in its
               slot, see --dry-run), --steps timed steps per point (5): peak memory (reserved and
               allocated, and the activations' part of it: the peak less memory at the step's
               start), step time against its bound (the link and the drive measured in the same
               run, in the step's pattern), the training thread's time blocked on the offloader
               beyond the IO deficit, tokens/s for keep, offload (memory, posix) and full
               recompute at micro-batch K (--micro-batch, 2), then keep, full recompute and
               adaptive (timed once it settled) at K+1 in a memory budget that fits keep at K but
               not at K+1; the last timed step of each point as a Chrome trace in <out>/traces

A bitwise or stress step that its time limit stops before the steps it names is NOT RUN, with
the count. It prints one row per target (gpu_check_targets.py): PASS, FAIL or NOT RUN
with the reason, and exits 0 only when every target passed. ``gpu-check.json`` (everything) and
``table.txt`` are rewritten in --out after every step. ``GPU_CHECK_DRY=1`` (or --dry-run) prints
the time plan (each step's limit and estimate, their sums) and exits 1 if it does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .gpu_archive import archive_path, pack, remove, results_dir, scratch_dir, scratch_problem
from .gpu_bundle import REQUIREMENTS
from .gpu_drive import probe as probe_drive
from .gpu_drive import text as drive_text
from .gpu_check_plan import (DEADLINE_MARGIN_S, KILL_GRACE_S, KILL_WAIT_S, STEPS, TERM_WAIT_S, TOTAL_S, estimates,
                            measure_estimate, plan, print_plan)
from .gpu_check_targets import NOT_RUN, PASS, render, targets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The steps run single-node: gloo (megatron's CPU groups) binds the loopback device instead of
# resolving the host's name, which a bare box may not resolve; rendezvous on 127.0.0.1.
CHILD_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1", "NCCL_P2P_DISABLE": "1",
             "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
STEP_ENV = {"bitwise-gds-compat": {"KVIKIO_COMPAT_MODE": "ON"}}  # kvikio's own switch, read at import
SHAPE_FLAGS = ("layers", "hidden", "heads", "seq", "vocab", "micro_batch", "steps")


@dataclasses.dataclass(frozen=True)
class Suite:
    """A prepared run of steps, each in its own process under its own limit: gpu-check here,
    gpu-perf in gpu_perf.py. The parent below runs either."""

    name: str
    """How its lines start ("gpu-check: ...")."""
    module: str
    """The module its children run (``python -m``) with --child."""
    steps: Sequence[tuple]
    """(name, limit in seconds, the steps it needs, what it does), in order."""
    plan: Callable[[argparse.Namespace], List[dict]]
    header: Callable[[argparse.Namespace], dict]
    """What the results' header says of the plan (estimates)."""
    print_plan: Callable[..., bool]
    targets: Callable[..., List[dict]]
    render: Callable[[dict], str]
    child_flags: Tuple[str, ...]
    """The options every child gets, as the parent got them."""
    run_step: str
    """"module:function" a child runs its step with: (args, save) -> result."""
    groups: Dict[str, Tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Names --only takes for several steps at once."""

    def say(self, msg: str) -> None:
        print(f"{self.name}: {msg}", flush=True)


# -- the parent: plan, run the steps, report ------------------------------------------------

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = suite_parser("gpu_check", __doc__, "gpu-check-results", TOTAL_S)
    p.add_argument("--layers", type=_positive_int, default=8, help="measure: layers (default: %(default)s)")
    p.add_argument("--hidden", type=_positive_int, default=2048, help="measure: hidden size (default: %(default)s)")
    p.add_argument("--heads", type=_positive_int, default=16, help="measure: attention heads (default: %(default)s)")
    p.add_argument("--seq", type=_positive_int, default=1024, help="measure: sequence length (default: %(default)s)")
    p.add_argument("--vocab", type=_positive_int, default=8192, help="measure: vocabulary (default: %(default)s)")
    p.add_argument("--micro-batch", type=_positive_int, default=2,
                   help="measure: micro-batch K compared side by side; K+1 then runs in a budget keep "
                        "cannot fit (default: %(default)s)")
    args = finish_args(p, CHECK, argv)
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    return args


def suite_parser(prog: str, doc: str, out: str, total_s: int) -> argparse.ArgumentParser:
    """The options every suite has (its results folder, the bundle, the scratch directory, the
    dry run, --only, its time limit, the timed steps per point)."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=out,
                   help="where the run leaves its one archive, <out>/%s-results.tar.gz, and nothing else "
                        "(default: %%(default)s)" % prog.replace("_", "-"))
    p.add_argument("--wheels", default=".whl", help="folder of the bundle, `make gpu-bundle` (default: %(default)s)")
    p.add_argument("--scratch", default=os.path.join(REPO, ".gpu-scratch"),
                   help="directory on the drive to offload to, outside --out; the run uses and removes "
                        "<scratch>/<suite>-scratch/ there: the drive's files and the installed bundle "
                        "(default: the checkout's disk, %(default)s)")
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY", "") not in ("", "0"),
                   help="only print the time plan and check that it fits (also GPU_CHECK_DRY=1)")
    p.add_argument("--only", default=None,
                   help="comma-separated steps (or groups of steps: gpu-check's after-perf is every step but "
                        "measure, which gpu-perf covers) to run, with the steps they need (default: all; the "
                        "targets of the others are NOT RUN, so the exit status is 1)")
    p.add_argument("--total-s", type=_positive_int, default=total_s,
                   help="time limit of the whole run, seconds (default: %(default)s)")
    p.add_argument("--steps", type=_positive_int, default=5,
                   help="timed steps per measured point; a target judges a point on 5 or more (default: %(default)s)")
    return p


def finish_args(p: argparse.ArgumentParser, suite: Suite, argv: Optional[List[str]]) -> argparse.Namespace:
    """The options every suite has (--child, and --only checked against its steps), parsed;
    paths made absolute; ``args.suite`` set."""
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [s[0] for s in suite.steps]
    if args.only:
        args.only = ",".join(n for part in args.only.split(",") for n in suite.groups.get(part, (part,)))
        bad = [n for n in args.only.split(",") if n not in names]
        if bad:
            groups = "".join(f"; {g}: {', '.join(s)}" for g, s in suite.groups.items())
            p.error(f"--only: unknown step(s) {', '.join(bad)}; steps: {', '.join(names)}{groups}")
    args.out = os.path.abspath(args.out)
    args.wheels = os.path.abspath(args.wheels)
    args.scratch = os.path.abspath(args.scratch)
    if not args.child and scratch_problem(args.out, args.scratch):
        p.error(scratch_problem(args.out, args.scratch))
    args.suite = suite
    return args


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


class Results:
    """<suite>.json and table.txt in --out, rewritten after every step."""

    def __init__(self, out: str, header: dict, suite: Suite) -> None:
        self.out, self.suite = out, suite
        self.data = {"header": header, "steps": {}, "targets": []}
        self.missing: Dict[str, str] = {}
        os.makedirs(out, exist_ok=True)

    def step(self, name: str, result: dict) -> None:
        self.data["steps"][name] = result
        self.write()

    def write(self) -> None:
        self.data["targets"] = self.suite.targets(self.data["steps"], self.missing)
        tmp = os.path.join(self.out, f"{self.suite.name}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.out, f"{self.suite.name}.json"))
        with open(os.path.join(self.out, "table.txt"), "w") as f:
            f.write(self.suite.render(self.data) + "\n")


def run_parent(args: argparse.Namespace) -> int:
    """The run: its results in ``<out>/<suite>-results/``, packed into the one archive under
    --out in a ``finally`` (SIGTERM, SIGINT and SIGHUP end the run through it, the step in
    flight killed first), ``table.txt`` printed; its scratch under --scratch removed."""
    import signal

    suite = args.suite
    work = results_dir(args.out, suite.name)
    scratch = scratch_dir(args.scratch, suite.name)
    for stale in (work, scratch):  # a run killed before its finally
        remove(stale)
    os.makedirs(work)
    previous = {sig: signal.signal(sig, _terminated) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    # The children see the results folder as their --out and the drive's folder as their --scratch.
    run = argparse.Namespace(**dict(vars(args), out=work, scratch=os.path.join(scratch, "drive")))
    code = 1
    try:
        code = _run_steps(run, os.path.join(scratch, "prefix"), os.path.join(scratch, "torch_extensions"))
    except Terminated as exc:
        suite.say(f"stopped: {exc}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _finish(suite, args.out, work, scratch)
    return code


def _finish(suite: Suite, out: str, work: str, scratch: str) -> None:
    """table.txt to stdout, the results folder into the archive (then removed), scratch removed."""
    remove(scratch)
    table = os.path.join(work, "table.txt")
    if os.path.exists(table):
        with open(table) as f:
            print(f.read(), end="", flush=True)
    packed = pack(work, archive_path(out, suite.name))
    remove(work)
    left = f"; left out (over its size): {', '.join(packed['left_out'])}" if packed["left_out"] else ""
    suite.say(f"archive {packed['path']}: {packed['bytes']:,} bytes, {packed['files']} files{left}")


def _run_steps(args: argparse.Namespace, prefix: str, extensions: str) -> int:
    suite = args.suite
    say = suite.say
    start = time.monotonic()
    steps = suite.plan(args)
    header = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
              "dry_run": args.dry_run, "out": args.out, "scratch": args.scratch, "wheels": args.wheels,
              "plan": steps, "total_s": args.total_s, "drive": probe_drive(args.scratch), **suite.header(args)}
    if args.dry_run:
        say(f"dry run: the time plan ({len(steps)} steps, each in its own process under its limit):")
        fits = suite.print_plan(args, steps, say)
        say(drive_text(header["drive"]))
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(header, f, indent=1)
        return 0 if fits else 1
    res = Results(args.out, header, suite)
    selected = {s["step"] for s in steps}
    res.missing.update({n: "not selected (--only)" for n, *_ in suite.steps if n not in selected})
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    env = dict(os.environ, **CHILD_ENV)
    env["PYTHONPATH"] = _pythonpath(prefix)
    env["TORCH_EXTENSIONS_DIR"] = env.get("TORCH_EXTENSIONS_DIR", extensions)
    banked = 0.0  # install's unused seconds, given to the step after it
    try:
        for s in steps:
            name, timeout = s["step"], s["timeout_s"] + banked
            banked = 0.0
            left = args.total_s - (time.monotonic() - start) - 5
            blocked = next((d for d in s["needs"] if res.data["steps"].get(d, {}).get("status") != "pass"), None)
            if blocked:
                dep = res.data["steps"].get(blocked, {})  # the first step that did not pass, and why
                why = dep.get("root") or f"step {blocked} {dep.get('status', 'not run')}: {dep.get('why', '')}"
                result = {"status": "not run", "why": why, "root": why}
            elif left < 10:
                result = {"status": "not run", "why": f"out of time ({args.total_s}s for the whole check)"}
            else:
                limit = int(min(timeout, left))
                say(f"{name}: running (limit {limit}s) ...")
                t0 = time.monotonic()
                result = install(args, prefix, env, limit) if name == "install" else run_child(args, name, env, limit)
                result["seconds"] = round(time.monotonic() - t0, 1)
                if name == "install":
                    env["PYTHONPATH"] = _pythonpath(prefix)  # where pip put them, now that it has
                    banked = max(0.0, limit - result["seconds"]) if result["status"] == "pass" else 0.0
                result["limit_s"] = limit
            res.step(name, result)
            say(f"{name}: {result['status']}{' (%ss)' % result['seconds'] if 'seconds' in result else ''}"
                f"{' - ' + result['why'] if result.get('why') else ''}")
    except Terminated as exc:  # the step in flight was stopped (run_child): what it saved is its result
        res.data["stopped"] = str(exc)
        if name not in res.data["steps"]:
            partial = _load(os.path.join(args.out, "steps", f"{name}.json")) or {}
            res.data["steps"][name] = dict(partial, status="error", why=f"the run was stopped: {exc}")
        res.write()
        raise
    rows = res.data["targets"]
    passed = sum(t["result"] == PASS for t in rows)
    not_run = sum(t["result"] == NOT_RUN for t in rows)
    say(f"{passed} of {len(rows)} targets PASS, {len(rows) - passed - not_run} FAIL, {not_run} NOT RUN; "
        f"the results ({suite.name}.json, table.txt, steps/, logs/, traces/) in the archive below")
    return 0 if passed == len(rows) else 1


def prefix_sites(prefix: str) -> List[str]:
    """The folders of ``prefix`` that pip installed packages into: this Python's scheme for a
    prefix, and whatever site-packages / dist-packages pip made there (a distribution's
    patched scheme may differ from what sysconfig predicts)."""
    predicted = {sysconfig.get_path(k, vars={"base": prefix, "platbase": prefix}) for k in ("purelib", "platlib")}
    found = {os.path.join(root, d) for root, dirs, _ in os.walk(prefix) if root.count(os.sep) - prefix.count(os.sep) < 4
             for d in dirs if d in ("site-packages", "dist-packages")}
    return sorted(predicted | found)


def _pythonpath(prefix: str) -> str:
    """The checkout first, then the bundle installed into ``prefix``, then the caller's own."""
    return os.pathsep.join([REPO] + prefix_sites(prefix) + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


def install(args: argparse.Namespace, prefix: str, env: dict, limit: int) -> dict:
    """The bundle, offline, into ``prefix``: pip installs there only what the box lacks (or has
    in a version the requirements refuse); what the box has stays in use."""
    wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    if not wheels:
        return {"status": "not run", "why": f"no wheels in {args.wheels}: run `make gpu-bundle` on a machine "
                                            "with network and carry .whl/ to this one"}
    log_path = os.path.join(args.out, "logs", "install.log")
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--no-index", "--find-links", args.wheels,
           "--prefix", prefix, "--no-compile", "--no-warn-script-location"] + REQUIREMENTS
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit,
                                preexec_fn=_die_with(os.getpid())).returncode
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "why": f"pip install ran over {limit}s; see {log_path}"}
    out = {"command": " ".join(cmd), "rc": rc, "wheels": [os.path.basename(w) for w in wheels]}
    if rc != 0:
        return dict(out, status="fail", why=f"pip install --no-index failed (rc {rc}): {_tail(log_path)}")
    return dict(out, status="pass", summary=_tail(log_path, 1))


def run_child(args: argparse.Namespace, name: str, env: dict, limit: int) -> dict:
    result_path = os.path.join(args.out, "steps", f"{name}.json")
    os.makedirs(os.path.dirname(result_path), exist_ok=True)
    if os.path.exists(result_path):
        os.unlink(result_path)
    log_path = os.path.join(args.out, "logs", f"{name}.log")
    cmd = [sys.executable, "-m", args.suite.module, "--child", name, "--out", args.out,
           "--scratch", args.scratch] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in args.suite.child_flags]
    # The kill path inside the limit: SIGTERM at limit - KILL_GRACE_S (the child saves what it
    # has, as Terminated), SIGKILL after TERM_WAIT_S, then at most KILL_WAIT_S more; the child's
    # own deadline DEADLINE_MARGIN_S before the SIGTERM, so it rarely needs one.
    term_at = max(limit - KILL_GRACE_S, 1)
    child_env = dict(env, GPU_CHECK_DEADLINE=str(time.time() + term_at - DEADLINE_MARGIN_S), **STEP_ENV.get(name, {}))
    with open(log_path, "w") as log:
        # Its own session, so that the kill path reaches whatever it started; and it dies with
        # this process, whatever kills it (a SIGKILL included): the GPU is not left held.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
                                preexec_fn=_die_with(os.getpid()))
        try:
            rc = proc.wait(timeout=term_at)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        except BaseException:  # this process stopped (a signal): the step goes first, as at its limit
            _kill_group(proc)
            raise
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


PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with(parent: int) -> Callable[[], None]:
    """What a step's process runs before its program (``preexec_fn``): SIGTERM to it when
    ``parent`` ends (Linux's parent-death signal, kept across exec), and an exit at once if
    ``parent`` already ended between the fork and the call."""

    def arm() -> None:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL if it is still there TERM_WAIT_S later;
    returns at most KILL_GRACE_S after it was called."""
    import signal

    for sig, wait in ((signal.SIGTERM, TERM_WAIT_S), (signal.SIGKILL, KILL_WAIT_S)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
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


# -- the children: one step each, in their own process --------------------------------------

class Terminated(BaseException):
    """SIGTERM in a step's process (the parent's time limit, or anyone's kill): raised in the
    main thread, so the step unwinds and its last result is saved with where it stopped. A
    BaseException: a step's ``except Exception`` does not swallow it."""


def _terminated(signum: int, frame) -> None:
    import signal

    raise Terminated(f"signal {signum} ({signal.Signals(signum).name}): stopped from outside, most likely the "
                     f"time limit (the step's, or the run's)")


def child(args: argparse.Namespace) -> int:
    """One step in this process: its result saved at ``<out>/steps/<step>.json`` each time the
    step saves one, and once more at the end. Whatever ends it (an exception, a CUDA error,
    SIGTERM) the last result the step saved is kept, with the status "error", the exception
    and its traceback beside what it measured."""
    import signal
    import traceback

    path = os.path.join(args.out, "steps", f"{args.child}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    last: Dict[str, object] = {}

    def save(result: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, path)
        last.clear()
        last.update(result)

    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        os.makedirs(args.scratch, exist_ok=True)  # the step before it removed its own
        module, function = args.suite.run_step.split(":")
        run_step = getattr(importlib.import_module(module), function)  # the steps import torch
        result = run_step(args, save)
    except BaseException as exc:  # noqa: BLE001 - reported in the result, and the exit status
        traceback.print_exc()
        save(dict(last, status="error", why=f"{type(exc).__name__}: {exc}"[:2000],
                  traceback=traceback.format_exc()[-4000:]))
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        remove(args.scratch)  # the drive's files; the parent removes the run's scratch too
    save(result)
    return 0


def check_header(args: argparse.Namespace) -> dict:
    return {"estimates": estimates(args), "measure_estimate": measure_estimate(args),
            "measure_shape": {k: getattr(args, k) for k in SHAPE_FLAGS}}


CHECK = Suite("gpu-check", f"{__package__}.gpu_check", STEPS, plan, check_header, print_plan, targets, render,
              SHAPE_FLAGS, f"{__package__}.gpu_check_steps:run_step",
              groups={"after-perf": tuple(n for n, *_ in STEPS if n != "measure")})
"""gpu-check. ``--only after-perf`` is the second of the two GPU calls (docs/gpu-check.md): every
step but measure, whose shape gpu-perf measured in the first."""


def run(args: argparse.Namespace) -> int:
    """The parent, or with --child one step in this process."""
    if args.child:
        return child(args)
    return run_parent(args)


def main(argv: Optional[List[str]] = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
