"""The megatron-core releases ``install()`` supports, and what differs between them.

This is the one module that knows megatron-core versions apart; the hooks in ``scopes.py`` and
``pipeline.py`` are written against the behaviour all four releases share, and ``install()``
asks :func:`release_for` where each patch point lives. What differs:

=====================  ==============================  ===========================================
                       0.16                            0.17 / 0.18 / 0.19
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
``get_forward_         ``(pp_size, vp_size)``          0.19: ``schedule_pg_collection`` added
backward_func``
RoPE at a full-        one tensor                      0.19: two tensors (local, global), so a
recompute checkpoint                                   checkpoint's inputs are one longer
``megatron.training``  not in the wheel                0.17+: shipped in the wheel
imports                                                0.18+: triton at module level (schedules);
                                                       parts of megatron.training use
                                                       ``typing.override`` (Python 3.12)
=====================  ==============================  ===========================================

The 0.17-0.19 wheels declare ``Requires-Python >=3.12`` yet install and run on 3.11 with
``pip install --ignore-requires-python``; nothing in the patched paths needs 3.12.

Before patching, :func:`verify` checks that the functions have the parameters this table says
(a later patch release that changes one fails there, with the names, instead of misbehaving).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Release", "RELEASES", "SUPPORTED_MEGATRON_CORE", "UnsupportedMegatronVersion",
           "megatron_core_version", "release_for", "recompute_patch_point", "verify",
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
)}

SUPPORTED_MEGATRON_CORE: Tuple[str, ...] = tuple(RELEASES)
"""megatron-core minor versions the patches were written and tested against."""

_REQUIREMENT = "'megatron-core>=0.16,<0.20'"


def _supported_text() -> str:
    return (", ".join(r.minor + ".x" for r in RELEASES.values())
            + " (tested: " + ", ".join(r.tested for r in RELEASES.values()) + ")")


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


def release_for(version: str) -> Release:
    """The :class:`Release` of megatron-core ``version``.

    Raises:
        UnsupportedMegatronVersion: an older or newer minor version.
    """
    minor = ".".join(version.split(".")[:2])
    release = RELEASES.get(minor)
    if release is None:
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is not supported by ssdtrain_megatron.megatron: its "
            f"patches were written and tested against megatron-core {_supported_text()}. "
            f"Install {_REQUIREMENT}, or run without --ssd-offload.")
    return release


# -- patch points ------------------------------------------------------------------------------


def recompute_patch_point(release: Release) -> Tuple[Any, str, bool]:
    """``(owner, name, is_method)`` of the full-recompute driver: the block method (0.16, 0.17)
    or the module-level function taking the block first (0.18+)."""
    module = importlib.import_module(release.recompute_module)
    if release.recompute_is_method:
        cls_name, name = release.recompute_name.split(".")
        return getattr(module, cls_name), name, True
    return module, release.recompute_name, False


def _params(fn: Callable) -> Tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def verify(release: Release, version: str) -> None:
    """Check that the imported megatron-core has the patch points ``release`` describes.

    Raises:
        UnsupportedMegatronVersion: one is missing or has other parameters; the message names
            it, what it has and what was expected.
    """
    from megatron.core.pipeline_parallel import schedules

    problems: List[str] = []
    owner, name, _ = recompute_patch_point(release)
    if name not in vars(owner):
        problems.append(f"{release.recompute_module}.{release.recompute_name} is missing")
    for fn_name in release.backward_steps:
        if not callable(vars(schedules).get(fn_name)):
            problems.append(f"schedules.{fn_name} is missing")
    checks = (("backward_step", release.backward_step_params),
              ("get_forward_backward_func", release.forward_backward_func_params))
    for fn_name, expected in checks:
        fn = vars(schedules).get(fn_name)
        if callable(fn) and _params(fn) != expected:
            problems.append(f"schedules.{fn_name}{_params(fn)} (expected {expected})")
    if problems:
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} does not have the patch points of megatron-core "
            f"{release.minor}.x that ssdtrain_megatron.megatron was tested against: "
            f"{'; '.join(problems)}. Install megatron-core=={release.tested}, or run without "
            f"--ssd-offload.")


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
