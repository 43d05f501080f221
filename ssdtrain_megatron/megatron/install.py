"""install() / uninstall(): the monkey-patches that connect the offloader to megatron-core.

Patched (megatron-core 0.16.x-0.20.x, and a newer minor release with
``OffloadConfig.allow_untested_megatron``; :mod:`.compat` says where each point lives in each
release), and restored exactly by ``uninstall()``:

- ``TransformerLayer.forward``: layer scope; recompute fallback.
- the full-recompute driver (``TransformerBlock._checkpointed_forward`` in 0.16/0.17,
  ``megatron.core.recompute.checkpointed_forward`` from 0.18): which block's layers a
  full-recompute checkpoint covers.
- ``tensor_parallel.checkpoint`` (``tensor_parallel.random.checkpoint``): the layer scope of a
  full-recompute checkpoint's saved inputs.
- ``pipeline_parallel.schedules.forward_step``: micro-batch scope.
- ``pipeline_parallel.schedules.backward_step`` (and, 0.17+, ``backward_step_multimodule``):
  backward hint.
- ``pipeline_parallel.schedules.get_forward_backward_func``: step end (StepStats).
- ``tensor_parallel.CheckpointWithoutOutput.checkpoint``: outputs megatron frees and recomputes
  itself stay with autograd (:mod:`.discarded`).

The free functions are replaced under every module-level name a loaded module holds them by
(``megatron.core.pipeline_parallel.get_forward_backward_func`` re-exports one; a module that did
``from megatron.core.pipeline_parallel.schedules import forward_step`` holds another). A
reference stored elsewhere before ``install()`` keeps megatron's own function.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

from ..config import OffloadConfig
from . import compat, handle, patch_points
from .compat import SUPPORTED_MEGATRON_CORE, UnsupportedMegatronVersion, megatron_core_version
from .discarded import DiscardedOutputs
from .patching import Installation, Patcher
from .pipeline import INTERLEAVED, NO_PIPELINING, ONE_F_ONE_B, PipelineHooks
from .scopes import LayerScopes

log = logging.getLogger(__name__)

__all__ = ["SUPPORTED_MEGATRON_CORE", "UnsupportedMegatronVersion", "megatron_core_version",
           "check_megatron_version", "installed", "install", "uninstall"]

INTEGRATION = "megatron-core"


def check_megatron_version(version: Optional[str] = None, allow_untested: bool = False) -> str:
    """Raise UnsupportedMegatronVersion unless ``version`` (default: the version of the
    megatron-core this process imports) is a supported megatron-core release, or, with
    ``allow_untested``, a newer minor release. Returns the version."""
    version = megatron_core_version() if version is None else version
    compat.release_for(version, allow_untested)
    return version


def installed() -> Optional[Installation]:
    """The current megatron-core installation, or None (see handle.py: one per process)."""
    return handle.installed(INTEGRATION)


def install(config: OffloadConfig, offloader=None):
    """Patch megatron-core so every training step run through ``get_forward_backward_func()``
    offloads its activations.

    Args:
        config: the offloader settings. With ``recompute_fallback`` on, the layers in
            ``recompute_layers`` (megatron's global, 1-based ``layer_number``) run under
            megatron's ``tensor_parallel.checkpoint`` instead of being offloaded.
        offloader: an ActivationOffloader built from ``config`` to use instead of a new one
            (e.g. to switch between two offloaders step by step with ``uninstall(close=False)``).

    Returns:
        The ActivationOffloader; ``uninstall()`` closes it.

    Raises:
        UnsupportedMegatronVersion: megatron-core is missing, older than 0.16 or newer than
            0.20 (unless ``config.allow_untested_megatron``), or its patch points differ from
            those of its release (for a newer one: of the newest release known).
        RuntimeError: already installed (this integration or DeepSpeed's: one per process).
        ConfigError: from building the offloader.

    Example:
        >>> offloader = install(OffloadConfig(dirs=["/mnt/nvme0/ssdtrain"]))
        >>> forward_backward = get_forward_backward_func()  # after install()
        >>> forward_backward(forward_step_func=..., ...)
        >>> offloader.last_step_stats.bytes_offloaded
    """
    version = megatron_core_version()
    release = compat.release_for(version, config.allow_untested_megatron)
    handle.check_free(INTEGRATION)
    layers = frozenset(config.recompute_layers) if config.recompute_fallback else frozenset()

    from ..cache import ActivationOffloader

    patch_points.verify(release, version)
    if compat.is_untested(version):
        log.warning(compat.untested_warning(release, version))
    if offloader is None:
        offloader = ActivationOffloader(config)
    patcher = Patcher()
    try:
        scopes, pipeline = _hooks(offloader, layers, release)
        _patch(patcher, scopes, pipeline, release)
    except BaseException:
        patcher.restore()
        offloader.close()
        raise
    handle.claim(INTEGRATION, Installation(offloader, patcher, scopes, pipeline))
    log.info("ssdtrain: installed into megatron-core %s (%d patches; recompute fallback "
             "layers: %s)", version, len(patcher), sorted(layers) or "none")
    return offloader


def _hooks(offloader, layers, release):
    """The layer scopes and the schedule hooks, wrapping megatron's unpatched functions."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_layer import TransformerLayer

    recompute_owner, recompute_name, _ = compat.recompute_patch_point(release)
    scopes = LayerScopes(
        offloader, layers,
        layer_forward=vars(TransformerLayer)["forward"],
        block_checkpointed_forward=vars(recompute_owner)[recompute_name],
        checkpoint=vars(tp_random)["checkpoint"])
    kinds = {
        schedules.forward_backward_no_pipelining: NO_PIPELINING,
        schedules.forward_backward_pipelining_without_interleaving: ONE_F_ONE_B,
        schedules.forward_backward_pipelining_with_interleaving: INTERLEAVED,
    }
    backward_steps = {name: vars(schedules)[name] for name in release.backward_steps}
    pipeline = PipelineHooks(offloader, scopes, vars(schedules)["forward_step"],
                             backward_steps, kinds)
    return scopes, pipeline


def _patch(patcher: Patcher, scopes: LayerScopes, pipeline: PipelineHooks, release) -> None:
    """Replace megatron's patch points with the hooks (``patcher`` can undo every one)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_layer import TransformerLayer

    recompute_owner, recompute_name, recompute_is_method = compat.recompute_patch_point(release)
    patcher.replace_attribute(TransformerLayer, "forward",
                              _method(scopes.layer_forward, TransformerLayer.forward))
    if recompute_is_method:
        patcher.replace_attribute(
            recompute_owner, recompute_name,
            _method(scopes.block_checkpointed_forward,
                    vars(recompute_owner)[recompute_name]))
    else:
        # 0.18+: a function taking the block first; transformer_block and the hybrid block
        # imported it by name, so every module-level reference is replaced.
        patcher.replace_function(
            recompute_owner, recompute_name,
            lambda orig: _function(scopes.block_checkpointed_forward, orig))
    # tensor_parallel re-exports random.checkpoint: replace_function finds both names.
    patcher.replace_function(tp_random, "checkpoint",
                             lambda orig: _function(scopes.checkpoint, orig))
    patcher.replace_function(schedules, "forward_step",
                             lambda orig: _function(pipeline.forward_step, orig))
    for name in release.backward_steps:
        # backward_step_multimodule (0.17+) is bound into a functools.partial inside the
        # 1F1B schedule at each call, by its module-level name: patching the name reaches it.
        patcher.replace_function(
            schedules, name,
            lambda orig, name=name: _function(pipeline.backward_hook(name), orig))
    patcher.replace_function(schedules, "get_forward_backward_func",
                             lambda orig: _get_forward_backward_func(pipeline, orig))
    without_output = getattr(tp_random, "CheckpointWithoutOutput", None)
    if without_output is not None:
        discarded = DiscardedOutputs(scopes.offloader, vars(without_output)["checkpoint"])
        patcher.replace_attribute(without_output, "checkpoint",
                                  _method(discarded.checkpoint, without_output.checkpoint))


def uninstall(close: bool = True) -> None:
    """Restore every patched megatron-core attribute; close the offloader unless ``close`` is
    False (closing removes every file it wrote). A no-op when nothing is installed."""
    inst = handle.release(INTEGRATION)
    if inst is not None:
        inst.undo(close)


def _function(hook: Callable, original: Callable) -> Callable:
    """A module-level replacement for ``original`` that calls ``hook``."""

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return hook(*args, **kwargs)

    return patched


def _method(hook: Callable, original: Callable) -> Callable:
    """A replacement method (binds like ``original``) that calls ``hook(self, ...)``."""

    @functools.wraps(original)
    def patched(self, *args, **kwargs):
        return hook(self, *args, **kwargs)

    return patched


def _get_forward_backward_func(pipeline: PipelineHooks, original: Callable) -> Callable:
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        fb = original(*args, **kwargs)
        return pipeline.wrap_forward_backward(fb) if pipeline.active else fb

    return get_forward_backward_func
