"""install() / uninstall(): the monkey-patches that connect the offloader to DeepSpeed, for
Megatron-DeepSpeed (and any model trained by a DeepSpeed engine).

Patched, and restored exactly by ``uninstall()``:

- ``PipelineEngine.train_batch``: the step; ``offloader.end_step()`` when it returns.
- ``PipelineEngine._exec_schedule``: the step's instruction schedule, read ahead.
- ``PipelineEngine._INSTRUCTION_MAP`` (and the map of each subclass that has its own, such as
  ``DualPipeVEngine``): its ``ForwardPass`` / ``BackwardPass`` entries switch the offloader's
  micro-batch and start the reads of the next backward (:mod:`.ds_pipeline`).
- ``DeepSpeedEngine.forward`` / ``backward`` / ``step``: the same without a pipeline.
- ``deepspeed.checkpointing.CheckpointFunction``: checkpoint inputs are offloaded, recomputed
  tensors stay in memory; partition_activations and cpu_checkpointing combine as described in
  :mod:`.ds_checkpoint`.
- ``forward`` of each layer class the user names (default: Megatron-DeepSpeed's
  ``ParallelTransformerLayer``, by name): layer scopes. Classes given by name are found in the
  model the first time an engine trains it, and patched then.

This is the only module of the package that imports deepspeed (lazily: importing it does not).
Written against DeepSpeed 0.19 (tested: 0.19.8, CPU and gloo); ``install()`` checks that every
patch point exists and names any that does not.

Example:
    >>> from ssdtrain_megatron import OffloadConfig
    >>> from ssdtrain_megatron.megatron import deepspeed as ssd_deepspeed
    >>> offloader = ssd_deepspeed.install(OffloadConfig(dirs=["/mnt/nvme0/ssdtrain/{job}"]))
    >>> engine, *_ = deepspeed.initialize(model=pipeline_module, config=ds_config)
    >>> loss = engine.train_batch(data_iter)       # activations offloaded
    >>> offloader.last_step_stats.summary()
    >>> ssd_deepspeed.uninstall()                  # DeepSpeed exactly as before; files removed
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable, List, Optional, Union

from ..config import ConfigError, OffloadConfig
from .ds_checkpoint import (DEFAULT_LAYER_CLASSES, DeepSpeedCheckpointSettings, LayerScopes,
                            offloading_checkpoint_function)
from .ds_pipeline import EngineHooks
from . import handle, patching
from .patching import Patcher

log = logging.getLogger(__name__)

TESTED_DEEPSPEED = "0.19.8"
"""The DeepSpeed release the patches were tested against."""

LayerClasses = Union[None, str, type, Iterable[Union[str, type]]]


class UnsupportedDeepSpeedVersion(RuntimeError):
    """DeepSpeed is missing, or lacks a function or attribute the patches need."""


class Installation(patching.Installation):
    """One install(): the offloader, the patches, the hooks' state, and the engines'
    instruction maps wrapped so far."""

    def __init__(self, offloader, patcher: Patcher, scopes: LayerScopes, hooks: EngineHooks,
                 settings: DeepSpeedCheckpointSettings) -> None:
        super().__init__(offloader, patcher, scopes, hooks)
        self.checkpoint_settings = settings
        self._maps: List[type] = []

    def patch_instruction_map(self, engine_cls: type) -> None:
        """Wrap the ForwardPass / BackwardPass entries of the ``_INSTRUCTION_MAP`` that
        ``engine_cls`` uses (the nearest class in its MRO that defines one), once."""
        owner = next((c for c in engine_cls.__mro__ if "_INSTRUCTION_MAP" in vars(c)), None)
        if owner is None or owner in self._maps:
            return
        hooks = self.pipeline
        original = vars(owner)["_INSTRUCTION_MAP"]
        wrapped = dict(original)
        for instruction, fn in original.items():
            if getattr(fn, "_ssdtrain_instruction", False):
                continue  # a subclass map built from an already patched one
            if issubclass(instruction, hooks.forward_cls):
                wrapped[instruction] = _instruction(hooks.forward_pass, fn)
            elif issubclass(instruction, hooks.backward_cls):
                wrapped[instruction] = _instruction(hooks.backward_pass, fn)
        self.patcher.replace_attribute(owner, "_INSTRUCTION_MAP", wrapped)
        self._maps.append(owner)


INTEGRATION = "deepspeed"


def deepspeed_version() -> str:
    """The installed DeepSpeed version (distribution metadata; no import)."""
    from importlib import metadata

    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError as exc:
        raise UnsupportedDeepSpeedVersion(
            "ssdtrain_megatron.megatron.deepspeed needs DeepSpeed (pip install deepspeed; tested "
            f"with {TESTED_DEEPSPEED}); it is not installed") from exc


def _patch_points():
    """Import DeepSpeed's patched modules; check that every patch point exists."""
    version = deepspeed_version()
    try:
        from deepspeed.runtime import engine as ds_engine
        from deepspeed.runtime.activation_checkpointing import checkpointing
        from deepspeed.runtime.pipe import engine as pipe_engine
        from deepspeed.runtime.pipe import schedule
    except ImportError as exc:
        raise UnsupportedDeepSpeedVersion(f"importing DeepSpeed {version} failed: {exc}") from exc
    required = [(ds_engine.DeepSpeedEngine, "forward"), (ds_engine.DeepSpeedEngine, "backward"),
                (ds_engine.DeepSpeedEngine, "step"), (pipe_engine.PipelineEngine, "train_batch"),
                (pipe_engine.PipelineEngine, "_exec_schedule"),
                (pipe_engine.PipelineEngine, "_INSTRUCTION_MAP"), (schedule, "ForwardPass"),
                (schedule, "BackwardPass"), (checkpointing, "CheckpointFunction"),
                (checkpointing, "PARTITION_ACTIVATIONS"), (checkpointing, "CPU_CHECKPOINT")]
    missing = [f"{getattr(o, '__name__', o)}.{name}" for o, name in required
               if not hasattr(o, name)]
    if not missing:
        instruction_map = pipe_engine.PipelineEngine._INSTRUCTION_MAP
        missing = [f"PipelineEngine._INSTRUCTION_MAP[{c.__name__}]"
                   for c in (schedule.ForwardPass, schedule.BackwardPass)
                   if c not in instruction_map]
    if missing:
        raise UnsupportedDeepSpeedVersion(
            f"DeepSpeed {version} lacks {', '.join(missing)}, which ssdtrain's DeepSpeed "
            f"integration patches (written against DeepSpeed 0.19, tested {TESTED_DEEPSPEED}); "
            "install deepspeed 0.19.x or run without --ssd-offload")
    return version, ds_engine, pipe_engine, schedule, checkpointing


def check_deepspeed() -> str:
    """Raise UnsupportedDeepSpeedVersion unless DeepSpeed is installed and has every patch
    point. Returns its version."""
    return _patch_points()[0]


def installed() -> Optional[Installation]:
    """The current DeepSpeed installation, or None (see handle.py: one per process)."""
    return handle.installed(INTEGRATION)


def install(config: OffloadConfig, layer_classes: LayerClasses = None):
    """Patch DeepSpeed so that every training step of its engines offloads its activations.

    Call it once this rank's device is selected (the offloader offloads tensors on DeepSpeed's
    current device), before ``deepspeed.initialize()`` or after; every engine trained afterwards
    is covered. Megatron-DeepSpeed: right after ``initialize_megatron``, which is what the
    launcher and ``patches/megatron-deepspeed.patch`` do.

    Args:
        config: the offloader settings. ``recompute_fallback`` is megatron-core only: refused.
        layer_classes: the module classes whose forward is one layer (a layer scope for
            prefetching, ``keep_last_layers`` and per-layer statistics): classes, or class names
            (matched anywhere in a module's MRO). Default: ``("ParallelTransformerLayer",)``.

    Returns:
        The ActivationOffloader; ``uninstall()`` closes it.

    Raises:
        UnsupportedDeepSpeedVersion: DeepSpeed is missing or lacks a patch point.
        ConfigError: ``config.recompute_fallback`` is set.
        RuntimeError: already installed (this integration or megatron-core: one per process).
    """
    handle.check_free(INTEGRATION)
    _refuse_recompute_fallback(config)
    classes = _layer_classes(layer_classes)
    version, ds_engine, pipe_engine, schedule, checkpointing = _patch_points()

    import torch
    from deepspeed.accelerator import get_accelerator

    from ..cache import ActivationOffloader

    device = torch.device(get_accelerator().current_device_name())
    offloader = ActivationOffloader(config, device=device)
    patcher = Patcher()
    try:
        scopes = LayerScopes(offloader, classes,
                             lambda cls: patcher.replace_attribute(
                                 cls, "forward", _method(scopes.layer_forward, cls.forward)))
        hooks = EngineHooks(offloader, scopes, pipe_engine.PipelineEngine, schedule.ForwardPass,
                            schedule.BackwardPass,
                            getattr(checkpointing, "non_reentrant_checkpoint", None))
        settings = DeepSpeedCheckpointSettings(checkpointing)
        inst = Installation(offloader, patcher, scopes, hooks, settings)
        scopes.patch_given_classes()

        _patch_engines(patcher, inst, hooks, ds_engine.DeepSpeedEngine, pipe_engine.PipelineEngine)
        # deepspeed.checkpointing.checkpoint() looks CheckpointFunction up at each call, so every
        # caller (PipelineModule, Megatron-DeepSpeed's tensor_parallel.checkpoint) gets this one.
        patcher.replace_function(
            checkpointing, "CheckpointFunction",
            lambda base: offloading_checkpoint_function(base, scopes, settings))
        if settings.contiguous:
            settings.warn_contiguous()
    except BaseException:
        patcher.restore()
        offloader.close()
        raise
    handle.claim(INTEGRATION, inst)
    log.info("ssdtrain: installed into DeepSpeed %s (%d patches; layer classes: %s)", version,
             len(patcher), ", ".join(c if isinstance(c, str) else c.__qualname__ for c in classes))
    return offloader


def uninstall(close: bool = True) -> None:
    """Restore every patched DeepSpeed attribute (and layer class); close the offloader unless
    ``close`` is False (closing removes every file it wrote). A no-op when nothing is installed."""
    inst = handle.release(INTEGRATION)
    if inst is not None:
        inst.undo(close)


# -- helpers ---------------------------------------------------------------------------------


def _refuse_recompute_fallback(config: OffloadConfig) -> None:
    if config.recompute_fallback:
        raise ConfigError(
            "OffloadConfig.recompute_fallback=True is invalid with DeepSpeed: the recompute "
            "fallback runs layers under megatron-core's checkpoint and exists only in the "
            "megatron-core integration. With DeepSpeed, recompute with DeepSpeed's activation "
            "checkpointing (--checkpoint-activations with --deepspeed-activation-checkpointing, "
            "or PipelineModule(activation_checkpoint_interval=...)): its checkpoint inputs are "
            "offloaded.", field="recompute_fallback", value=True,
            allowed="false with DeepSpeed (use DeepSpeed's activation checkpointing)")


def _patch_engines(patcher: Patcher, inst: Installation, hooks: EngineHooks, engine_cls: type,
                   pipe_cls: type) -> None:
    """Route DeepSpeedEngine's forward/backward/step and PipelineEngine's schedule through the
    hooks (and every PipelineEngine subclass's instruction map)."""
    for name, hook in (("forward", hooks.engine_forward), ("backward", hooks.engine_backward),
                       ("step", hooks.engine_step)):
        patcher.replace_attribute(engine_cls, name, _method(hook, vars(engine_cls)[name]))
    patcher.replace_attribute(pipe_cls, "train_batch",
                              _method(hooks.train_batch, vars(pipe_cls)["train_batch"]))
    patcher.replace_attribute(pipe_cls, "_exec_schedule", _method(
        functools.partial(_exec_schedule, inst), vars(pipe_cls)["_exec_schedule"]))
    for cls in [pipe_cls, *_subclasses(pipe_cls)]:
        inst.patch_instruction_map(cls)


def _layer_classes(layer_classes: LayerClasses) -> List[Any]:
    if layer_classes is None:
        return list(DEFAULT_LAYER_CLASSES)
    if isinstance(layer_classes, (str, type)):
        return [layer_classes]
    return list(layer_classes)


def _subclasses(cls: type) -> List[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def _exec_schedule(inst: Installation, original: Callable, engine, *args, **kwargs):
    # A PipelineEngine subclass defined after install() brings its own instruction map.
    if inst.pipeline.active:
        inst.patch_instruction_map(type(engine))
    return inst.pipeline.exec_schedule(original, engine, *args, **kwargs)


def _method(hook: Callable, original: Callable) -> Callable:
    """A replacement method (binds like ``original``) that calls ``hook(original, self, ...)``."""

    @functools.wraps(original)
    def patched(self, *args, **kwargs):
        return hook(original, self, *args, **kwargs)

    return patched


def _instruction(hook: Callable, original: Callable) -> Callable:
    """An ``_INSTRUCTION_MAP`` entry (called as ``MethodType(entry, engine)(**cmd.kwargs)``)."""

    @functools.wraps(original)
    def instruction(self, **kwargs):
        return hook(original, self, **kwargs)

    instruction._ssdtrain_instruction = True
    return instruction
