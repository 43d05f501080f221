"""``ssdtrain doctor --preflight``: the launcher's pre-flight, for every local rank of a node at
once, before torchrun starts there (megatron/preflight.py says what is checked).

The launch scripts run it once per node (scripts/ssdtrain_node.sh ``--preflight``, through
``srun --ntasks-per-node=1`` under Slurm) with the arguments the launcher will get, after
``--``. A failing node prints one line on stderr (the first problem, then the others) naming
the node, its local ranks, the path and the fix, and the command exits 2; a node that passes
prints nothing.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any, List

from .cli_types import UsageError, positive_int


def add_preflight_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "pre-flight (what the launch scripts run on each node before torchrun)")
    group.add_argument("--preflight", action="store_true",
                       help="check this node as the launcher will before Megatron starts, for "
                            "every local rank: the --ssd-offload flags and preset, each root "
                            "(exists, a directory, writable, not on the filesystem of /), free "
                            "space against the preset's model, the engine; one line on stderr "
                            "and exit 2 for a node that fails, nothing when it passes")
    group.add_argument("--nproc-per-node", type=positive_int, default=1, metavar="N",
                       help="local ranks on this node (torchrun's --nproc-per-node; default 1)")
    group.add_argument("--nnodes", type=positive_int, default=None, metavar="K",
                       help="nodes of the job: the world size is K x --nproc-per-node, and the "
                            "data-parallel size the world size over tp x pp x cp (default: "
                            "WORLD_SIZE where set, else the preset's dp)")
    group.add_argument("--node-rank", type=int, default=0, metavar="R",
                       help="this node's rank: {rank} is R x N + the local rank (default 0)")
    group.add_argument("launch_args", nargs="*", metavar="-- LAUNCHER_ARGS",
                       help="with --preflight: the launcher's arguments (Megatron's and the "
                            "--ssd-offload flags, after --); default: --ssd-offload with --dir "
                            "and --config")


def launcher_argv(args: argparse.Namespace) -> List[str]:
    """The launcher arguments to check: those after ``--``, else ``--ssd-offload`` with the
    doctor's ``--dir`` and ``--config``."""
    if args.launch_args:
        return list(args.launch_args)
    argv = ["--ssd-offload"]
    if args.dir:
        argv += ["--ssd-offload-dir", ",".join(args.dir)]
    if args.config:
        argv += ["--ssd-offload-config", args.config]
    return argv


def ranks_text(local_ranks: Any) -> str:
    """``local rank 3``, ``local ranks 0-7``, ``local ranks 0, 2``."""
    ranks = sorted(local_ranks)
    if len(ranks) == 1:
        return f"local rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"local ranks {ranks[0]}-{ranks[-1]}"
    return "local ranks " + ", ".join(map(str, ranks))


def preflight_json(launch: Any, ranks: List[Any], problems: List[Any]) -> dict:
    """``--preflight --json``: per local rank, the settings install() will take (plan/job.py's
    Settings.summary(), what ``ssdtrain plan -- ARGS`` prints), with the engine's line, the
    notes, and the problems found."""
    settings = launch.settings
    summary = settings.summary() if settings is not None else {}
    return {"ranks": [{"rank": i.rank, "local_rank": i.local_rank, **summary} for i in ranks],
            "engine_choice": launch.choice.reason if launch.choice else None,
            "notes": list(settings.notes) if settings is not None else [],
            "problems": [{"local_ranks": list(p.local_ranks), "what": p.what} for p in problems]}


def run_preflight(args: argparse.Namespace) -> int:
    from ..io.layout import Identity
    from ..megatron.preflight import FlagError, check, read_launch

    if args.node_rank < 0:
        raise UsageError(f"--node-rank: expected an integer >= 0, got {args.node_rank}")
    host = socket.gethostname()
    prefix = f"ssdtrain doctor: error: node {host}"
    world = args.nnodes * args.nproc_per_node if args.nnodes else None
    try:
        launch = read_launch(launcher_argv(args), local_ranks=args.nproc_per_node, world=world)
    except FlagError as exc:
        if getattr(args, "json", False):  # the format asked for (tools/refusal.py)
            from .refusal import refuse

            return refuse("doctor", f"node {host}: {exc}", True)
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    if launch is None:
        raise UsageError("--preflight: the launcher arguments after -- have no --ssd-offload: "
                         "nothing to check")
    job = launch.config.job_id()
    n = args.nproc_per_node
    ranks = [Identity(args.node_rank * n + lr, lr, host, job) for lr in range(n)]
    problems = check(launch, ranks)
    if getattr(args, "json", False):
        print(json.dumps(preflight_json(launch, ranks, problems), indent=1))
        return 2 if problems else 0
    if not problems:
        return 0
    first, rest = problems[0], problems[1:]
    more = "; ".join(f"{ranks_text(p.local_ranks)}: {p.what}" for p in rest)
    print(f"{prefix}, {ranks_text(first.local_ranks)}: {first.what}"
          + (f" (and {len(rest)} more on this node: {more})" if rest else ""), file=sys.stderr)
    return 2
