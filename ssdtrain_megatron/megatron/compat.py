"""The megatron-core releases ``install()`` supports, and what differs between them.

This is the one module that knows megatron-core versions apart; the hooks in ``scopes.py`` and
``pipeline.py`` are written against the behaviour all these releases share, and ``install()``
asks :func:`release_for` where each patch point lives. What differs:

=====================  ==============================  ===========================================
                       0.16                            0.17 / 0.18 / 0.19 / 0.20
=====================  ==============================  ===========================================
full recompute         ``TransformerBlock.             0.17: the same method (gained
                       _checkpointed_forward``         ``extract_layer_indices``, ``layer_offset``);
                                                       0.18+: the free function
                                                       ``megatron.core.recompute.checkpointed_
                                                       forward(block, ...)``, imported by name
                                                       into transformer_block and the hybrid block
``backward_step``      ``(input_tensor, output_tensor, 0.17+: ``model_type`` dropped
                       output_tensor_grad, model_type,
                       config)``
multi-module 1F1B      (none)                          ``backward_step_multimodule``, called through
                                                       a ``functools.partial`` built per step (it
                                                       looks the name up at call time, so patching
                                                       the module attribute reaches it)
``get_forward_         ``(pp_size, vp_size)``          0.19+: ``schedule_pg_collection`` added
backward_func``
RoPE at a full-        one tensor                      0.19+: two tensors (local, global), so a
recompute checkpoint                                   checkpoint's inputs are one longer
``megatron.training``  not in the wheel                0.17+: shipped in the wheel
imports                                                0.18+: triton at module level (schedules);
                                                       parts of megatron.training use
                                                       ``typing.override`` (Python 3.12)
=====================  ==============================  ===========================================

0.20 (Megatron-LM ``main``; no wheel on PyPI yet) has 0.19's patch points with the same
parameters; read against 0.19.2 at main d98e8a64dd (2026-08-22), what moved around them:

- ``schedules.forward_step`` / ``backward_step`` are decorated with a tracing decorator
  (``megatron.core.telemetry``): without nemo-lens it returns the function itself; with it, a
  wrapper, which is what the module attribute holds and what ``install()`` wraps in turn.
  ``TransformerLayer.forward`` runs its body inside a tracing span (a no-op without nemo-lens).
- ``megatron.core.recompute`` is unchanged; ``tensor_parallel.checkpoint`` takes the same
  arguments (its backward now also runs during a CUDA graph capture).
- ``CheckpointWithoutOutput`` gained a manager that discards the outputs of many checkpoints
  at once (mHC recompute); every checkpoint still goes through
  ``CheckpointWithoutOutput.checkpoint``, the method ``install()`` wraps (discarded.py).
- A new layer class, ``HyperConnectionTransformerLayer`` (``enable_mhc_connections``),
  overrides ``forward`` without calling ``TransformerLayer.forward``: its layers save outside
  a layer scope (offloaded as layer None, no per-layer plan), and the offloader's watch names
  them in ``StepStats.not_offloaded_why`` (cache/silence.py). Read, not run: no test trains
  mHC.
- The arguments ``compat`` reads (``cpu_offloading*``, ``fine_grained_activation_offloading``,
  ``enable_cuda_graph``, ``external_cuda_graph``, ``cuda_graph_impl``) are unchanged, as are
  ``parse_args`` and ``initialize_megatron``, which the launcher wraps.

The 0.17-0.19 wheels declare ``Requires-Python >=3.12`` yet install and run on 3.11 with
``pip install --ignore-requires-python``; nothing in the patched paths needs 3.12.

Before patching, ``patch_points.verify`` checks that the functions have the parameters this
table says (a later patch release that changes one fails there, with the names, instead of
misbehaving).

A minor release newer than the newest here is refused, unless the user allows it
(``--ssd-offload-allow-untested-megatron``, ``OffloadConfig.allow_untested_megatron``): it then
runs with the newest release's patch points, once ``patch_points.verify`` has found every one of them
with its expected parameters, and ``install()`` logs one warning saying so
(:func:`untested_warning`). An older release is refused either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Release", "RELEASES", "SUPPORTED_MEGATRON_CORE", "UnsupportedMegatronVersion",
           "megatron_core_version", "release_for", "newest_release", "is_untested",
           "untested_warning", "install_hint", "recompute_patch_point",
           "megatron_offloading_in_use", "refuse_megatron_offloading", "cuda_graphs_in_use",
           "refuse_cuda_graphs", "pipeline_position"]


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not one the patches were written and tested against."""


@dataclass(frozen=True)
class Release:
    """Where one megatron-core minor release keeps what ``install()`` patches."""

    minor: str
    """"0.16", "0.17", ..."""
    tested: str
    """The patch release the test suite ran against."""
    recompute_module: str
    """Module holding the full-recompute driver."""
    recompute_name: str
    """``Class.method`` or a module-level function name in ``recompute_module``."""
    backward_steps: Tuple[str, ...]
    """``schedules`` functions that run one micro-batch's backward."""
    backward_step_params: Tuple[str, ...]
    """Parameters of ``schedules.backward_step``, in order."""
    forward_backward_func_params: Tuple[str, ...]
    """Parameters of ``schedules.get_forward_backward_func``, in order."""
    rope_tensors_at_checkpoint: int
    """How many of a full-recompute checkpoint's inputs RoPE takes."""
    ships_training: bool
    """The wheel contains ``megatron.training`` (Megatron-LM's training loop)."""
    checkout: str = ""
    """For a release with no wheel yet: the Megatron-LM commit (and its date) whose
    ``megatron/core`` the tests ran against; empty for a release tested from its wheel."""

    @property
    def recompute_is_method(self) -> bool:
        return "." in self.recompute_name


_BLOCK = "megatron.core.transformer.transformer_block"
_BACKWARD_016 = ("input_tensor", "output_tensor", "output_tensor_grad", "model_type", "config")
_BACKWARD_017 = ("input_tensor", "output_tensor", "output_tensor_grad", "config")

RELEASES: Dict[str, Release] = {r.minor: r for r in (
    Release("0.16", "0.16.1", _BLOCK, "TransformerBlock._checkpointed_forward",
            ("backward_step",), _BACKWARD_016, ("pp_size", "vp_size"), 1, False),
    Release("0.17", "0.17.1", _BLOCK, "TransformerBlock._checkpointed_forward",
            ("backward_step", "backward_step_multimodule"), _BACKWARD_017,
            ("pp_size", "vp_size"), 1, True),
    Release("0.18", "0.18.2", "megatron.core.recompute", "checkpointed_forward",
            ("backward_step", "backward_step_multimodule"), _BACKWARD_017,
            ("pp_size", "vp_size"), 1, True),
    Release("0.19", "0.19.2", "megatron.core.recompute", "checkpointed_forward",
            ("backward_step", "backward_step_multimodule"), _BACKWARD_017,
            ("pp_size", "vp_size", "schedule_pg_collection"), 2, True),
    # Megatron-LM main, which reports 0.20.0: tested from a checkout (no 0.20 wheel yet).
    Release("0.20", "0.20.0", "megatron.core.recompute", "checkpointed_forward",
            ("backward_step", "backward_step_multimodule"), _BACKWARD_017,
            ("pp_size", "vp_size", "schedule_pg_collection"), 2, True,
            checkout="Megatron-LM main d98e8a64dd of 2026-08-22"),
)}

SUPPORTED_MEGATRON_CORE: Tuple[str, ...] = tuple(RELEASES)
"""megatron-core minor versions the patches were written and tested against."""

_REQUIREMENT = "'megatron-core>=0.16,<0.21'"
_ALLOW_FLAG = "--ssd-offload-allow-untested-megatron"


def _tested_text(release: Release) -> str:
    return f"{release.tested} at {release.checkout}" if release.checkout else release.tested


def _supported_text() -> str:
    return (", ".join(r.minor + ".x" for r in RELEASES.values())
            + " (tested: " + ", ".join(_tested_text(r) for r in RELEASES.values()) + ")")


def install_hint(release: Release) -> str:
    """How to get the megatron-core ``release`` was tested with, as a sentence's start."""
    if release.checkout:
        return f"Use {release.checkout} (megatron-core {release.tested})"
    return f"Install megatron-core=={release.tested}"


# -- the version of the megatron that is imported ----------------------------------------------

_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([0-9A-Za-z.]*)['\"]?\s*$")


def _version_from_package_info(path: str) -> Optional[str]:
    """MAJOR.MINOR.PATCH[PRE_RELEASE] from a package_info.py, read as text: executing it would
    run ``git`` in a checkout (it appends the commit to ``__version__``)."""
    fields: Dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                match = _FIELD.match(line.strip())
                if match and match.group(1) not in fields:
                    fields[match.group(1)] = match.group(2)
    except OSError:
        return None
    if not all(k in fields for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"


def _megatron_core_folder() -> Optional[str]:
    """The folder of the ``megatron.core`` that is (or would be) imported, without importing
    it: a wrong version may not even import cleanly."""
    module = sys.modules.get("megatron.core")
    paths = list(getattr(module, "__path__", []) or []) if module is not None else []
    if not paths:
        try:
            spec = importlib.util.find_spec("megatron.core")  # imports only `megatron`
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return None
        paths = list(spec.submodule_search_locations or [])
    return paths[0] if paths else None


def megatron_core_version() -> str:
    """The version of the megatron-core that ``import megatron.core`` gives this process (a
    checkout earlier on ``sys.path`` wins over the installed wheel, as it does for imports):
    read from that package's ``package_info.py``; the distribution metadata only where the
    package has none.

    Raises:
        UnsupportedMegatronVersion: no megatron.core can be found.
    """
    folder = _megatron_core_folder()
    if folder is not None:
        version = _version_from_package_info(os.path.join(folder, "package_info.py"))
        if version is not None:
            return version
    from importlib import metadata

    for dist in ("megatron-core", "megatron_core"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    raise UnsupportedMegatronVersion(
        f"ssdtrain_megatron.megatron needs megatron-core {_supported_text()}: pip install "
        f"{_REQUIREMENT} (on Python 3.11 add --ignore-requires-python for 0.17 and later); "
        f"no megatron.core can be imported here")


_MINOR = re.compile(r"^(\d+)\.(\d+)")


def _minor_key(version: str) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a version string ("0.21.0rc1" -> (0, 21)); None if it has none."""
    match = _MINOR.match(version.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def newest_release() -> Release:
    """The newest megatron-core minor release in the table."""
    return max(RELEASES.values(), key=lambda r: _minor_key(r.minor) or (0, 0))


def is_untested(version: str) -> bool:
    """Whether ``version`` is a minor release newer than any in the table."""
    key = _minor_key(version)
    return key is not None and key > (_minor_key(newest_release().minor) or (0, 0))


def release_for(version: str, allow_untested: bool = False) -> Release:
    """The :class:`Release` of megatron-core ``version``; with ``allow_untested``, for a minor
    release newer than any in the table, the newest one's (whose patch points
    ``patch_points.verify`` must then find in ``version``).

    Raises:
        UnsupportedMegatronVersion: an older minor version, or a newer one without
            ``allow_untested`` (the one-line message names the flag that allows it).
    """
    minor = ".".join(version.split(".")[:2])
    release = RELEASES.get(minor)
    if release is not None:
        return release
    if is_untested(version):
        newest = newest_release()
        if allow_untested:
            return newest
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is newer than any release ssdtrain_megatron.megatron was "
            f"tested against ({_supported_text()}). To try it with the patch points of "
            f"{newest.minor}.x, each checked first, add {_ALLOW_FLAG} (YAML: "
            f"allow_untested_megatron: true); or install {_REQUIREMENT}, or run without "
            f"--ssd-offload.")
    raise UnsupportedMegatronVersion(
        f"megatron-core {version} is not supported by ssdtrain_megatron.megatron: its "
        f"patches were written and tested against megatron-core {_supported_text()}. "
        f"Install {_REQUIREMENT}, or run without --ssd-offload.")


def untested_warning(release: Release, version: str) -> str:
    """The one warning line of a run that :func:`release_for` allowed with ``allow_untested``:
    the version, and what was assumed of it."""
    return (f"ssdtrain: megatron-core {version} is newer than any release tested "
            f"({_supported_text()}); running it because {_ALLOW_FLAG} is set, assuming it "
            f"keeps the patch points of megatron-core {release.minor}.x (tested: "
            f"{_tested_text(release)}), which were found with their expected parameters. "
            f"Losses and the bytes moved are not checked for this release: compare a short "
            f"run with and without --ssd-offload (docs/megatron.md)")


# -- patch points ------------------------------------------------------------------------------


def recompute_patch_point(release: Release) -> Tuple[Any, str, bool]:
    """``(owner, name, is_method)`` of the full-recompute driver: the block method (0.16, 0.17)
    or the module-level function taking the block first (0.18+)."""
    module = importlib.import_module(release.recompute_module)
    if release.recompute_is_method:
        cls_name, name = release.recompute_name.split(".")
        return getattr(module, cls_name), name, True
    return module, release.recompute_name, False


# -- megatron-core's own activation offloading -------------------------------------------------

# (attribute on TransformerConfig / Megatron's parsed args, the flag that turns it on)
_MCORE_OFFLOADING = (
    ("cpu_offloading", "--cpu-offloading-num-layers"),
    ("fine_grained_activation_offloading", "--fine-grained-activation-offloading"),
)


def megatron_offloading_in_use(obj: Any) -> List[Tuple[str, str]]:
    """megatron-core's own activation offloading turned on in ``obj`` (a TransformerConfig or
    Megatron's parsed arguments): ``(setting, flag)`` pairs. Both install saved-tensor hooks of
    their own (host memory), which ``--ssd-offload`` does not compose with."""
    found = []
    for attr, flag in _MCORE_OFFLOADING:
        if getattr(obj, attr, False) is True:
            found.append((attr, flag))
    if not any(a == "cpu_offloading" for a, _ in found) and \
            isinstance(getattr(obj, "cpu_offloading_num_layers", 0), int) and \
            getattr(obj, "cpu_offloading_num_layers", 0) > 0:
        found.append(("cpu_offloading", "--cpu-offloading-num-layers"))
    return found


def refuse_megatron_offloading(obj: Any) -> None:
    """Raise ValueError naming what to turn off when megatron-core's own activation offloading
    is on in ``obj`` together with ``--ssd-offload``."""
    found = megatron_offloading_in_use(obj)
    if found:
        names = " and ".join(f"{attr} ({flag})" for attr, flag in found)
        raise ValueError(
            f"--ssd-offload cannot run together with megatron-core's own activation offloading "
            f"to host memory: turn off {names}, or run without --ssd-offload")


# -- CUDA graphs -------------------------------------------------------------------------------


def cuda_graphs_in_use(obj: Any) -> List[str]:
    """The flags that turn on megatron's CUDA graphs in ``obj`` (a TransformerConfig or
    Megatron's parsed arguments), as the user typed them: ``--enable-cuda-graph``,
    ``--external-cuda-graph`` (both deprecated for ``--cuda-graph-impl``) and
    ``--cuda-graph-impl local|transformer_engine``.

    Why they do not compose with ``--ssd-offload``: a replayed graph's tensors live in
    static buffers that the next replay overwrites in place, with no version-counter bump and
    no event that orders an offload copy before it (the local implementation's replay node
    saves such buffers for backward); and what a capture records cannot contain the host-side
    IO offloading is made of. Graphed layers would therefore have to stay in memory, which is
    all that CUDA graphs and offload would share; ``--ssd-offload`` stops instead."""
    found = []
    if getattr(obj, "enable_cuda_graph", False) is True:
        found.append("--enable-cuda-graph")
    if getattr(obj, "external_cuda_graph", False) is True:
        found.append("--external-cuda-graph")
    impl = getattr(obj, "cuda_graph_impl", None)
    if isinstance(impl, str) and impl not in ("none", "") and not found:
        found.append(f"--cuda-graph-impl {impl}")
    return found


def refuse_cuda_graphs(obj: Any) -> None:
    """Raise ValueError, one line naming the flag to drop, when megatron's CUDA graphs are on
    in ``obj`` together with ``--ssd-offload``."""
    found = cuda_graphs_in_use(obj)
    if found:
        raise ValueError(cuda_graph_conflict(found))


def cuda_graph_conflict(flags: List[str]) -> str:
    return (f"--ssd-offload cannot run together with megatron's CUDA graphs: remove "
            f"{' and '.join(flags)}, or run without --ssd-offload")


# -- pipeline position -------------------------------------------------------------------------


def pipeline_position(p2p_communicator: Any) -> Optional[Tuple[int, int]]:
    """``(pipeline size, this rank's stage)`` from a schedule's ``p2p_communicator``: a
    P2PCommunicator (``pp_group``) or, 0.17+, a MultiModulePipelineCommunicator
    (``total_stages`` / ``current_stage``). None when it has neither."""
    group = getattr(p2p_communicator, "pp_group", None)
    if group is not None:
        return group.size(), group.rank()
    total = getattr(p2p_communicator, "total_stages", None)
    current = getattr(p2p_communicator, "current_stage", None)
    if isinstance(total, int) and isinstance(current, int):
        return total, current
    return None
