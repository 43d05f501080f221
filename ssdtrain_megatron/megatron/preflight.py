"""Pre-flight: what can be checked on a node before Megatron starts, each problem in one line.

A mistake in the offload settings that is found only once Megatron has initialised (an
unmounted drive, a root that is a file) costs a job slot and ends in a traceback on every rank;
found here, it costs one line. The launcher (``python -m ssdtrain_megatron.launch``) runs
:func:`launcher_problems` in every torchrun worker before it imports megatron, for every
local rank of the worker's node (so no worker goes on into Megatron while another on its node
stops), and ``ssdtrain doctor --preflight`` runs :func:`check` the same way once per node (the
Slurm and single-node scripts call it before torchrun starts). Checked, as the offloader
itself would (io/roots.py, io/layout.py):

- the ``--ssd-offload-*`` flags and the preset (``--ssd-offload-config``), as Megatron's parser
  will check them once the flag group is added to it;
- every root the ``dirs`` templates name for the rank: it exists (unless ``create_dirs``), is a
  directory, is not world-writable without the sticky bit, no directory a placeholder names is
  a symlink (layout.expand_root), two templates do not name one root, we can create a directory
  in it, and it is not on the filesystem of ``/`` unless ``allow_system_disk``;
- the free space of each drive against what the node's ranks keep on it at the peak of a step:
  the preset's model (``peak_disk_bytes`` in plan/model.py; Megatron's ``--num-layers``,
  ``--seq-length``, ``--micro-batch-size``, TP and PP flags, when given, win over the preset's
  shape) split over each rank's roots, less the host pool where the engine is ``tiered`` (named,
  or chosen by the node as the job will choose it: follow_node.py). Skipped without a preset
  that has a ``model:`` section, with ``policy: keep`` and with ``engine: memory``;
- the host memory per rank against megatron-core's optimizer CPU offload
  (``--optimizer-cpu-offload``, its fraction) and the pinned staging together (plan/job.py rule
  0, as install takes it): refused in one line with the fraction that fits;
- that the engine can run here (``is_available()``: DeepSpeed's aio op built or buildable,
  kvikio and CUDA for gds), without building anything;
- the ``stats_path`` and ``trace_path`` templates (layout.expand_file).

Nothing here imports megatron. ``SSDTRAIN_SKIP_PREFLIGHT=1`` in the environment turns the
launcher's pre-flight and the scripts' off (for a check that is wrong about a node).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import tempfile
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import OffloadConfig
from ..io.layout import Identity, LayoutError, expand_file, expand_roots, free_bytes
from ..io.roots import MISSING, check_root, on_system_disk, root_of, root_problem
from ..io.where import binary, filesystem_of
from ..plan.engine_choice import EngineChoice
from ..plan.job import JobError, Settings
from ..plan.model import peak_disk_bytes
from ..plan.shape import ModelShape
from ..plan.tiers import SSD
from .args import add_ssd_offload_args, flag_for
from .follow_node import settings_from_argv
from .host_memory import measure

SKIP_ENV = "SSDTRAIN_SKIP_PREFLIGHT"

def skipped(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``SSDTRAIN_SKIP_PREFLIGHT`` asks to skip the pre-flight."""
    return environ.get(SKIP_ENV, "") not in ("", "0")


class FlagError(ValueError):
    """The ``--ssd-offload-*`` flags or the preset cannot be used; argparse's one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse's hook: raise instead of exiting
        raise FlagError(message)


@dataclass(frozen=True)
class Launch:
    """What a launcher's argument list asks of the offloader: the settings the one sequence
    (plan/job.py) gives it, as install() will take them."""

    config: OffloadConfig
    preset: Optional[str]
    """The preset file (``--ssd-offload-config``), or None."""
    shape: Optional[ModelShape]
    """The model per GPU as the job runs it (Megatron's flags over the preset's); None
    without a model."""
    choice: Optional[EngineChoice] = None
    """How the engine was chosen (plan/engine_choice.py)."""
    settings: Optional[Settings] = None
    """Everything the job runs, with its plan (plan/job.py)."""


@dataclass(frozen=True)
class Problem:
    """One thing that would stop (or sink) the job: ``what`` names the path and the fix."""

    what: str
    local_ranks: Tuple[int, ...] = ()


def world_size(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """The job's world size where the environment says it (torchrun's WORLD_SIZE), else None
    (the preset's data-parallel size is then planned)."""
    text = environ.get("WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def parse_flags(argv: Sequence[str]) -> argparse.Namespace:
    """The ``--ssd-offload`` flag group of ``argv`` (the rest ignored), checked as Megatron's
    parser will check it.

    Raises:
        FlagError: a flag's value, the preset or their combination is invalid.
    """
    parser = add_ssd_offload_args(_Parser(add_help=False, allow_abbrev=False))
    with warnings.catch_warnings():  # deprecated flags: said once, when Megatron parses them
        warnings.simplefilter("ignore")
        args, _ = parser.parse_known_args(list(argv))
    return args


def read_launch(argv: Sequence[str], local_ranks: Optional[int] = None,
                environ: Mapping[str, str] = os.environ,
                world: Optional[int] = None) -> Optional[Launch]:
    """The offload settings of a launcher argument list, decided by the one sequence
    (follow_node.py, plan/job.py) as install() will decide them (``local_ranks``: the ranks
    sharing this node's host memory, default from ``environ``; ``world``: the job's world
    size, default ``environ``'s WORLD_SIZE); None when ``--ssd-offload`` is not among them.

    Raises:
        FlagError: a flag's value, the preset, their combination or the layout is invalid
            (one line naming the flag).
    """
    args = parse_flags(argv)
    if not args.ssd_offload:
        return None
    preset = args.ssd_offload_config
    try:
        host = measure(environ)
        if host is not None and local_ranks is not None:
            host = dataclasses.replace(host, local_ranks=local_ranks)
        settings = settings_from_argv(args, argv, host,
                                      world if world is not None else world_size(environ))
    except JobError as exc:
        raise FlagError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        where = f"argument --ssd-offload-config: {preset}: " if preset else ""
        raise FlagError(f"{where}{exc}") from None
    return Launch(settings.config, preset, settings.shape, settings.choice, settings)


# -- the checks -----------------------------------------------------------------------------


def check(launch: Launch, ranks: Sequence[Identity],
          node: Sequence[Identity] = ()) -> List[Problem]:
    """Every problem of the local ranks ``ranks`` (identical ones merged, with their ranks);
    ``node``: every local rank of the node, whose offloaded bytes share its drives (default:
    ``ranks``). Free space is looked at only when nothing else is wrong."""
    config = launch.config
    everyone = tuple(i.local_rank for i in ranks)
    found: List[Problem] = []
    why = engine_problem(config)
    if why:
        found.append(Problem(why, everyone))
    for ident in ranks:
        if config.engine != "memory":  # the only engine that writes no file
            found += [Problem(w, (ident.local_rank,)) for w in root_problems(config, ident)]
        found += [Problem(w, (ident.local_rank,)) for w in file_problems(config, ident)]
    if config.engine != "memory" and not found:
        found += space_problems(launch, ranks, node or ranks)
    merged: Dict[str, Tuple[int, ...]] = {}
    for p in found:
        merged[p.what] = tuple(sorted(set(merged.get(p.what, ()) + p.local_ranks)))
    return [Problem(what, who) for what, who in merged.items()]


def engine_problem(config: OffloadConfig) -> Optional[str]:
    """Why ``config.engine`` cannot run here (None when it can), from its ``is_available()``."""
    from ..io import engine_class

    try:
        ok, why = engine_class(config.engine).is_available()
    except Exception as exc:  # noqa: BLE001 - a probe that fails is a reason too
        ok, why = False, f"{type(exc).__name__}: {exc}"
    if ok:
        return None
    return (f"engine {config.engine!r} cannot run here: {why}; choose another with "
            f"--ssd-offload-engine (`ssdtrain doctor` lists the engines that run here)")


def root_problems(config: OffloadConfig, ident: Identity) -> List[str]:
    """What is wrong with the roots ``config.dirs`` name for ``ident``, one line each."""
    try:
        expand_roots(config.dirs, ident)  # placeholders, symlinks they name, duplicates
    except LayoutError as exc:
        return [str(exc)]
    out = []
    for i, template in enumerate(config.dirs):
        try:
            why = _root_problem(config, template, ident, i)
        except OSError as exc:  # e.g. a folder above the root we may not enter
            why = (f"cannot look at the offload root {root_of(template, ident)}: "
                   f"{exc.strerror or exc}: give the training user access to it, or point "
                   "--ssd-offload-dir elsewhere")
        if why:
            out.append(why)
    return out


def _root_problem(config: OffloadConfig, template: str, ident: Identity, index: int) -> Optional[str]:
    try:
        root = check_root(template, ident, index=index)
    except LayoutError as exc:
        missing = root_problem(root_of(template, ident)) == MISSING
        return None if config.create_dirs and missing else str(exc)  # create_dirs makes it
    why = _unwritable(root)
    if why is None and not config.allow_system_disk and on_system_disk(root):
        why = (f"offload root {root} is on the filesystem of / ({filesystem_of(root)[1]}): "
               "filling it can stop the node; put the roots on node-local NVMe "
               "(--ssd-offload-dir), or allow it with --ssd-offload-allow-system-disk "
               "(allow_system_disk: true)")
    return why


def _unwritable(root: str) -> Optional[str]:
    """Why we cannot create a directory in ``root`` (None when we can: the probe is removed)."""
    try:
        probe = tempfile.mkdtemp(prefix=".ssdtrain-preflight-", dir=root)
    except OSError as exc:
        return (f"offload root {root} is not writable by uid {os.getuid()} "
                f"({exc.strerror or exc}): give the training user a directory there (chown), "
                "mount the drive read-write, or point --ssd-offload-dir elsewhere")
    os.rmdir(probe)
    return None


def file_problems(config: OffloadConfig, ident: Identity) -> List[str]:
    """What is wrong with the ``stats_path`` and ``trace_path`` templates for ``ident``."""
    out = []
    for name in ("stats_path", "trace_path"):
        template = getattr(config, name)
        if template:
            try:
                expand_file(template, ident)
            except LayoutError as exc:
                out.append(f"{flag_for(name)}: {exc}")
    return out


def space_problems(launch: Launch, ranks: Sequence[Identity],
                   node: Sequence[Identity]) -> List[Problem]:
    """A drive that the ranks of ``node`` fill past its free space at the peak of a step, for
    each drive one of ``ranks`` writes to (see the module docstring)."""
    config, shape = launch.config, launch.shape
    if shape is None or config.policy == "keep":
        return []
    per_rank = disk_peak_bytes(launch)
    share = math.ceil(per_rank / len(config.dirs))  # tensors are striped over a rank's roots
    drives: Dict[int, Tuple[List[str], List[int]]] = {}  # st_dev -> (roots, local ranks)
    for ident in node:
        for template in config.dirs:
            try:
                root = root_of(template, ident)
                dev = os.stat(root).st_dev
            except (OSError, LayoutError):
                continue
            roots, who = drives.setdefault(dev, ([], []))
            roots.append(root)
            who.append(ident.local_rank)
    mine = {i.local_rank for i in ranks}
    out = []
    for roots, who in drives.values():
        need, free = share * len(who), free_bytes(roots[0])
        if share == 0 or need <= free or not mine & set(who):
            continue
        names = ", ".join(dict.fromkeys(roots))
        out.append(Problem(
            f"the drive of {names} ({filesystem_of(roots[0])[1]}) has {binary(free)} free, but "
            f"{len(set(who))} local rank(s) will keep up to {binary(need)} of activations there at "
            f"the peak of a step ({os.path.basename(launch.preset or '')}'s model: "
            f"{binary(per_rank)} per GPU of the first pipeline stage, over {len(config.dirs)} "
            f"root(s) each): free space there, add drives to --ssd-offload-dir, or set "
            f"{SKIP_ENV}=1 to start anyway (writes that do not fit stay in GPU memory)",
            tuple(sorted(mine & set(who)))))
    return out


def disk_peak_bytes(launch: Launch) -> int:
    """What one rank keeps on its drives at the peak of a step. The tiered engine places each
    layer where the plan says (plan/job.py): the plan's SSD layers for every micro-batch the
    first stage holds at once; what it keeps, puts in host memory or recomputes takes no drive.
    The other engines write every offloaded byte (plan/model.py ``peak_disk_bytes``)."""
    settings, config = launch.settings, launch.config
    if config.engine == "tiered" and settings is not None and settings.plan is not None:
        st = settings.stage
        ssd_layers = max(row.count(SSD) for row in settings.plan.decisions)
        return ssd_layers * st.layer_bytes * st.positions[0].live
    per_rank = peak_disk_bytes(launch.shape, config.keep_last_layers)
    if config.engine == "tiered":  # no plan: the host pool takes the first bytes
        per_rank = max(per_rank - config.host_memory_bytes, 0)
    return per_rank


# -- in the launcher --------------------------------------------------------------------------


LINGER_S = 5.0
"""How long a worker that found its node failing, but no problem of its own to name, waits
before it exits: torchrun stops every worker once one has exited, and the worker that names
the problem should get its line out first."""


def launcher_problems(argv: Sequence[str],
                      environ: Mapping[str, str] = os.environ) -> Tuple[List[str], bool]:
    """The pre-flight of one torchrun worker (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE from
    ``environ``): (the lines this worker prints, whether its node fails).

    Every worker checks every local rank of its node, so that none goes on into Megatron while
    another on its node stops; each problem is printed once per node, by the lowest local rank
    it concerns, naming the node and that rank. Nothing fails (and nothing is printed) when
    the offload settings can run here or ``--ssd-offload`` is not given.
    """
    host = socket.gethostname()
    rank, local = int(environ.get("RANK", "0")), int(environ.get("LOCAL_RANK", "0"))
    where = f"node {host}, rank {rank} (local rank {local})"
    try:
        launch = read_launch(argv, environ=environ)
    except FlagError as exc:
        return ([f"{where}: {exc}"] if local == 0 else []), True
    if launch is None:
        return [], False
    job = launch.config.job_id()
    local_ranks = max(int(environ.get("LOCAL_WORLD_SIZE", "1")), local + 1)
    node = [Identity(rank - local + lr, lr, host, job) for lr in range(local_ranks)]
    problems = check(launch, node)
    return [f"{where}: {p.what}" for p in problems if min(p.local_ranks, default=0) == local], \
        bool(problems)
