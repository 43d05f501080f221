"""Run a Megatron training script with the ``--ssd-offload`` flags, without editing it.

::

    torchrun --nproc-per-node 8 -m ssdtrain_megatron.launch \\
        /path/to/Megatron-LM/pretrain_gpt.py [Megatron args] --ssd-offload [--ssd-offload-* ...]

(or ``ssdtrain-pretrain`` in place of ``-m ssdtrain_megatron.launch``). Each torchrun worker
runs this module, which

1. makes the script's folder ``sys.path[0]`` and its arguments ``sys.argv``, as ``python
   SCRIPT`` would, so ``megatron`` is imported from the same place;
2. wraps Megatron's ``parse_args`` so that whatever ``extra_args_provider`` the script passes
   also adds the "ssd offload" group (:func:`~ssdtrain_megatron.megatron.args.add_ssd_offload_args`);
3. wraps ``initialize_megatron`` so that right after it returns (arguments parsed, process
   groups built, this rank's device selected) ``install()`` runs when ``--ssd-offload`` was
   given, with the engine the node calls for where neither the flags nor the preset name one
   (:mod:`.follow_node`: host memory is measured when the hooks are applied, before Megatron
   starts), saying in one line per rank which engine and why;
4. runs the script as ``__main__`` (runpy), then ``uninstall()``: every offload file is removed.

Before any of that, with ``--ssd-offload``, each worker runs the pre-flight (:mod:`.preflight`)
for its whole node: the flags and the preset, every local rank's roots, the free space of the
node's drives, the engine. A problem ends every worker of the node with exit status 2, before
megatron is imported, and one line on stderr (from the lowest local rank it concerns) names the
node, the rank, the path and the fix (``SSDTRAIN_SKIP_PREFLIGHT=1`` skips it). An error of ours
that leaves the script later, from inside Megatron's loop, is logged first in one ERROR line
naming the rank (:mod:`.errors`), then goes on with its traceback.

The same hooks, as :func:`with_ssd_offload`, are what the patches in ``patches/`` add to a
forked ``pretrain_gpt.py``: ``pretrain = with_ssd_offload(pretrain)``.

Two layouts of Megatron are known (:data:`TARGETS`): Megatron-LM on megatron-core
(``megatron.training.*``) and Megatron-DeepSpeed (``megatron.arguments``,
``megatron.initialize``). Nothing here imports megatron before the script's folder is on the
path.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import logging
import os
import runpy
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from ..config import ConfigError
from .args import add_ssd_offload_args, given_flags, with_ssd_offload_args
from .compat import cuda_graph_conflict, cuda_graphs_in_use, megatron_offloading_in_use
from . import host_memory, preflight
from .errors import report_error
from .follow_node import settings_from_args
from .patching import Patcher

log = logging.getLogger(__name__)

PROG = "ssdtrain-pretrain"


@dataclass(frozen=True)
class Target:
    """Where one Megatron layout keeps what the hooks wrap, and how offload is installed."""

    name: str
    arguments: str
    """Module defining ``parse_args(extra_args_provider=None, ...)``."""
    initialize: str
    """Module defining ``initialize_megatron(...)``."""
    global_vars: str
    """Module defining ``get_args()``."""
    installer: str
    """Module whose ``install(config)`` / ``uninstall()`` connect the offloader."""
    marker: str
    """A file, relative to a ``megatron`` package folder, that only this layout has."""
    recomputes: bool = True
    """Whether the recompute fallback can run there (Megatron-DeepSpeed refuses it): the
    engine the node chooses plans with it only then (follow_node.py)."""


MEGATRON_LM = Target("megatron-lm", "megatron.training.arguments", "megatron.training.initialize",
                     "megatron.training.global_vars", "ssdtrain_megatron.megatron",
                     os.path.join("training", "initialize.py"))
MEGATRON_DEEPSPEED = Target("megatron-deepspeed", "megatron.arguments", "megatron.initialize",
                            "megatron.global_vars", "ssdtrain_megatron.megatron.deepspeed",
                            "initialize.py", recomputes=False)
TARGETS = {t.name: t for t in (MEGATRON_LM, MEGATRON_DEEPSPEED)}


class LaunchError(RuntimeError):
    """The script cannot be run with offload; the message says why and what to do."""


def detect_target(search_path: Optional[Sequence[str]] = None) -> Target:
    """The layout of the ``megatron`` package that ``import megatron`` would find.

    Raises:
        LaunchError: no megatron package on the path, or one of neither layout.
    """
    folders: List[str] = []
    for entry in (sys.path if search_path is None else search_path):
        folder = os.path.join(entry or os.getcwd(), "megatron")
        if os.path.isdir(folder):
            folders.append(folder)
    for target in TARGETS.values():
        if any(os.path.isfile(os.path.join(f, target.marker)) for f in folders):
            return target
    if not folders:
        raise LaunchError("no 'megatron' package next to the script or on PYTHONPATH: run a "
                          "script of a Megatron-LM or Megatron-DeepSpeed checkout, or put the "
                          "checkout on PYTHONPATH")
    raise LaunchError(f"the megatron package in {', '.join(folders)} has neither "
                      "megatron/training/initialize.py (Megatron-LM) nor megatron/initialize.py "
                      "(Megatron-DeepSpeed); this launcher knows only those two layouts")


# -- install() from parsed Megatron arguments ------------------------------------------------


def _installer(target: Target) -> Any:
    try:
        return importlib.import_module(target.installer)
    except ImportError as exc:
        raise LaunchError(f"--ssd-offload with {target.name} needs {target.installer}, which "
                          f"cannot be imported: {exc}") from exc


_MEASURE = object()
"""install_from_args' default for ``host``: measure host memory at the call."""


def install_from_args(args: argparse.Namespace, target: Target = MEGATRON_LM,
                      host: Any = _MEASURE) -> Optional[Any]:
    """``install()`` of the settings the flags describe when ``args.ssd_offload`` is set; the
    offloader. Where neither the flags nor the preset name the engine, the node chooses it
    (follow_node.py) from ``host``: the host memory free at the job's start
    (host_memory.HostMemory, None where it cannot be measured; default: measured now), and
    one line per rank says which engine and why.

    Raises:
        LaunchError: megatron-core's own activation offloading (``--cpu-offloading-num-layers``,
            ``--fine-grained-activation-offloading``) is on too, or megatron's CUDA graphs
            (``--enable-cuda-graph``, ``--external-cuda-graph``, ``--cuda-graph-impl``); the
            one-line message names the flags to remove.

    Idempotent: when offload is already installed (a patched script run by the launcher),
    the installed offloader is returned. Without ``--ssd-offload`` nothing is installed, and a
    warning names any ``--ssd-offload-*`` flag that was given (it has no effect).
    """
    if not getattr(args, "ssd_offload", False):
        flags = given_flags(args)
        if flags:
            log.warning("ssdtrain: %s given without --ssd-offload: activations are not "
                        "offloaded; add --ssd-offload to turn it on", ", ".join(flags))
        return None
    conflicts = megatron_offloading_in_use(args)
    if conflicts:
        raise LaunchError(
            "--ssd-offload cannot run together with megatron-core's own activation offloading "
            "to host memory: remove " + " and ".join(flag for _, flag in conflicts)
            + ", or run without --ssd-offload")
    graphs = cuda_graphs_in_use(args)
    if graphs:
        raise LaunchError(cuda_graph_conflict(graphs))
    backend = _installer(target)
    current = getattr(backend, "installed", lambda: None)()
    if current is not None:
        return getattr(current, "offloader", current)
    try:
        settings = settings_from_args(args, host_memory.measure() if host is _MEASURE else host,
                                      recompute=target.recomputes)
    except ConfigError:
        raise
    except ValueError as exc:  # JobError, the preset's model or node, SSDTRAIN_HOST_MEMORY_FREE
        raise LaunchError(str(exc)) from None
    rank = getattr(args, "rank", 0)
    config = settings.config
    log.info("ssdtrain: rank %s: %s", rank, settings.choice.reason)
    log.info("ssdtrain: rank %s runs %s", rank, settings.line())
    for note in settings.notes:
        log.warning("ssdtrain: rank %s: %s", rank, note)
    offloader = backend.install(config)
    log.info("ssdtrain: rank %s offloads activations to %s (engine %s, policy %s)", rank,
             ", ".join(getattr(offloader, "rank_dirs", None) or config.dirs), config.engine,
             config.policy)
    return offloader


def uninstall(target: Target = MEGATRON_LM) -> None:
    """The target's ``uninstall()`` (closes the offloader: its files are removed)."""
    module = sys.modules.get(target.installer)
    if module is not None and hasattr(module, "uninstall"):
        module.uninstall()


# -- the hooks ------------------------------------------------------------------------------


class TrainingHooks:
    """Wraps ``parse_args`` (adds the flag group) and ``initialize_megatron`` (``install()``
    right after it) of one Megatron layout; ``restore()`` puts both back and uninstalls.

    Both functions are replaced under every module-level name a loaded module holds them by
    (``megatron.training.training`` imported ``initialize_megatron`` by name), and in their
    home modules, so modules imported later get the wrapped ones too.
    """

    def __init__(self, target: Target) -> None:
        self.target = target
        self._patcher = Patcher()
        self.offloader: Optional[Any] = None
        self._host: Any = None

    def apply(self) -> "TrainingHooks":
        # Host memory is measured now, before Megatron starts: no rank of the job has pinned
        # any yet, so every rank of a node sees the same figure. A bad SSDTRAIN_HOST_MEMORY_FREE
        # is said at install, and only with --ssd-offload.
        try:
            self._host = host_memory.measure()
        except ValueError as exc:
            self._host = exc
        arguments = importlib.import_module(self.target.arguments)
        initialize = importlib.import_module(self.target.initialize)
        try:
            self._patcher.replace_function(arguments, "parse_args", self._wrap_parse_args)
            self._patcher.replace_function(initialize, "initialize_megatron",
                                           self._wrap_initialize)
        except BaseException:
            self._patcher.restore()
            raise
        return self

    def restore(self) -> None:
        self._patcher.restore()
        if self.offloader is not None:
            self.offloader = None
            uninstall(self.target)

    def __enter__(self) -> "TrainingHooks":
        return self.apply()

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def _wrap_parse_args(self, parse_args: Callable) -> Callable:
        @functools.wraps(parse_args)
        def parse_args_with_ssd_offload(extra_args_provider: Optional[Callable] = None,
                                        *args: Any, **kwargs: Any) -> Any:
            return parse_args(with_ssd_offload_args(extra_args_provider), *args, **kwargs)

        return parse_args_with_ssd_offload

    def _wrap_initialize(self, initialize_megatron: Callable) -> Callable:
        @functools.wraps(initialize_megatron)
        def initialize_megatron_then_install(*args: Any, **kwargs: Any) -> Any:
            finish = initialize_megatron(*args, **kwargs)
            if callable(finish):
                # --lazy-mpu-init: Megatron returns the rest of its initialisation, which an
                # external launcher calls later; the device is chosen only then.
                @functools.wraps(finish)
                def finish_then_install(*a: Any, **kw: Any) -> Any:
                    result = finish(*a, **kw)
                    self._install()
                    return result

                return finish_then_install
            self._install()
            return finish

        return initialize_megatron_then_install

    def _install(self) -> None:
        get_args = importlib.import_module(self.target.global_vars).get_args
        args = get_args()
        if isinstance(self._host, ValueError) and getattr(args, "ssd_offload", False):
            raise LaunchError(str(self._host))
        host = None if isinstance(self._host, ValueError) else self._host
        offloader = install_from_args(args, self.target, host)
        if offloader is not None and self.offloader is None:
            self.offloader = offloader


def with_ssd_offload(pretrain: Callable, target: str = "megatron-lm") -> Callable:
    """``pretrain`` with the hooks around it: the flags parse, ``install()`` runs right after
    Megatron initialises, ``uninstall()`` when ``pretrain`` returns or raises.

    What the patches in ``patches/`` add to ``pretrain_gpt.py``::

        pretrain = with_ssd_offload(pretrain)
    """
    chosen = TARGETS[target]

    @functools.wraps(pretrain)
    def pretrain_with_ssd_offload(*args: Any, **kwargs: Any) -> Any:
        try:
            with TrainingHooks(chosen):
                return pretrain(*args, **kwargs)
        except BaseException as exc:
            report_error(exc)  # our one line, before the traceback
            raise

    return pretrain_with_ssd_offload


# -- the launcher ---------------------------------------------------------------------------


def run_script(script: str, script_args: Sequence[str]) -> None:
    """Run ``script`` as ``__main__`` with ``script_args``, the hooks applied around it."""
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise LaunchError(f"{script}: no such file (expected a Megatron training script such "
                          "as Megatron-LM/pretrain_gpt.py)")
    # As `python SCRIPT ARGS` sets them: megatron and the script's siblings (gpt_builders,
    # model_provider) are imported from the script's folder.
    sys.argv = [path, *script_args]
    sys.path.insert(0, os.path.dirname(path))
    hooks = TrainingHooks(detect_target())
    hooks.apply()
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException as exc:
        report_error(exc)  # our one line, before the traceback
        raise
    finally:
        hooks.restore()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, add_help=False, allow_abbrev=False,
        usage=f"torchrun [torchrun options] -m ssdtrain_megatron.launch SCRIPT [script args] "
              f"[--ssd-offload ...]\n       {PROG} SCRIPT [script args] [--ssd-offload ...]",
        description="Run a Megatron-LM (or Megatron-DeepSpeed) training script, e.g. "
                    "pretrain_gpt.py, with the --ssd-offload flags added to its own; install() "
                    "runs right after Megatron initialises. Run it under torchrun exactly as "
                    "the script itself.")
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    add_ssd_offload_args(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser = build_parser()
        (parser.print_help if argv else parser.print_usage)(sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    script, script_args = argv[0], argv[1:]
    if not preflight.skipped() and not {"-h", "--help"} & set(script_args):
        lines, failed = preflight.launcher_problems(script_args)
        for line in lines:
            print(f"{PROG}: error: {line}", file=sys.stderr)
        if failed:
            if not lines:  # another local rank names the problem: let its line out first
                time.sleep(preflight.LINGER_S)
            return 2
    try:
        run_script(script, script_args)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
