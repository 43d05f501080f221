"""Layer scopes from named module classes, and DeepSpeed checkpoints whose inputs are offloaded.

Used by :mod:`ssdtrain_megatron.megatron.deepspeed` (the only module that imports deepspeed: the
DeepSpeed classes arrive here as arguments).

**Layer scopes.** The forward of every module class the user names (by class object, or by class
name so that Megatron-DeepSpeed need not be importable: ``ParallelTransformerLayer`` by default)
runs inside ``offloader.layer(key)`` while a micro-batch forward is being recorded. A name
matches a class anywhere in a module's MRO, so Megatron-DeepSpeed's
``ParallelTransformerLayerPipe`` (a subclass that calls ``super().forward``) is covered by
``ParallelTransformerLayer``. The key is the module's ``layer_number`` when it has an integer
one, else its position among the matched modules of the model (plus the pipeline stage's
``_local_start``), so keys sort in forward order on every rank.

**Checkpoints.** DeepSpeed's ``CheckpointFunction`` keeps its inputs in
``ctx.deepspeed_saved_tensors``, a plain attribute: autograd's saved-tensor hooks never see
them, so without help they would sit in accelerator memory until backward. The subclass built
by :func:`offloading_checkpoint_function` runs DeepSpeed's own forward and backward unchanged
and, in between, hands what DeepSpeed keeps for backward to ``ctx.save_for_backward``, where the
offloader's hooks offload it; backward puts the (read back) tensors where DeepSpeed's backward
looks for them. What is routed depends on DeepSpeed's settings at that moment:

* neither ``partition_activations`` nor ``cpu_checkpointing``: every input tensor;
* ``partition_activations`` and/or ``cpu_checkpointing``: DeepSpeed empties each input and keeps
  its partition (or host copy) in the input's ``saved_data`` attribute; that tensor is routed,
  everything else stays exactly as DeepSpeed left it. A partition on the training device is
  offloaded (each tensor-parallel rank its own 1/tp share); a host copy is not on the training
  device and stays where cpu_checkpointing put it;
* the asynchronous cpu_checkpointing engine (non-synchronized accelerators, i.e. CUDA; its
  inputs carry ``ds_offload_id``): nothing of those inputs is routed, DeepSpeed's engine owns them;
* ``contiguous_memory_optimization``: nothing is routed (the inputs live in DeepSpeed's
  preallocated buffers, which offloading cannot free); warned once.

Only checkpoints run inside a recorded forward are routed; elsewhere (evaluation, the recompute
pass of an outer checkpoint) DeepSpeed's behaviour is untouched. Tensors the recompute pass
creates are saved during backward and stay in memory (the offloader never packs them).

A checkpoint's saved inputs belong to the first matched layer it runs (the layers inside run
under ``no_grad`` and save nothing themselves), found while its forward runs; a checkpoint
inside a layer (selective recomputation) belongs to that layer.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Hashable, Iterable, List, Optional, Set, Tuple

import torch

log = logging.getLogger(__name__)

DEFAULT_LAYER_CLASSES = ("ParallelTransformerLayer",)
"""Megatron-DeepSpeed's legacy transformer layer, matched by name."""


class _CheckpointFrame:
    """One running checkpoint forward: the layer scope its saved inputs get, once known."""

    def __init__(self) -> None:
        self.scope = contextlib.ExitStack()
        self.layer: Optional[Hashable] = None


class LayerScopes:
    """Per-install state behind the patched layer forwards and the checkpoint function.

    Args:
        offloader: the installed ActivationOffloader.
        layer_classes: module classes, or class names, whose forward is a layer scope.
        patch_forward: called once per class that needs its ``forward`` wrapped
            (``patch_forward(cls)``); the installation owns the patch and its restore.
    """

    def __init__(self, offloader, layer_classes: Iterable[Any],
                 patch_forward: Callable[[type], None]) -> None:
        self.offloader = offloader
        self.names: Set[str] = set()
        self.classes: Set[type] = set()
        for c in layer_classes:
            if isinstance(c, str):
                self.names.add(c)
            elif isinstance(c, type) and issubclass(c, torch.nn.Module):
                self.classes.add(c)
            else:
                raise TypeError(f"layer_classes entries must be torch.nn.Module subclasses or "
                                f"class names, not {c!r}")
        self._patch_forward = patch_forward
        self.patched: List[type] = []
        """Classes whose forward is wrapped, in the order they were found."""
        self.recording = False
        """True while a micro-batch forward of an offloaded step runs (set by the engine hooks)."""
        self._depth = 0
        self._frames: List[_CheckpointFrame] = []
        self._keys: "weakref.WeakKeyDictionary[torch.nn.Module, Hashable]" = \
            weakref.WeakKeyDictionary()
        self._models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._next_ordinal = 0
        self.checkpoints_routed = 0
        """Checkpoint forwards whose saved inputs went through the offloader (all steps)."""

    def patch_given_classes(self) -> None:
        """Patch the classes given as class objects now (names wait for a model to find them in)."""
        for cls in sorted(self.classes, key=lambda c: c.__qualname__):
            self._ensure_patched(cls)

    # -- finding the layers ---------------------------------------------------------------------

    def matching_class(self, cls: type) -> Optional[type]:
        """The class in ``cls``'s MRO that the user named, nearest first; None if none."""
        for c in cls.__mro__:
            if c in self.classes or c.__name__ in self.names:
                return c
        return None

    def discover(self, model: torch.nn.Module) -> None:
        """Find the named layer classes among ``model``'s modules (once per model), patch their
        forward, and number the layers in module order."""
        if model in self._models:
            return
        self._models.add(model)
        offset = getattr(model, "_local_start", 0)
        ordinal = 0
        for module in model.modules():
            cls = self.matching_class(type(module))
            if cls is None:
                continue
            number = getattr(module, "layer_number", None)
            if module not in self._keys:
                self._keys[module] = number if _is_int(number) else offset + ordinal
            ordinal += 1
            self._ensure_patched(cls)

    def key_of(self, module: torch.nn.Module) -> Hashable:
        key = self._keys.get(module)
        if key is None:  # a layer outside every model seen so far
            number = getattr(module, "layer_number", None)
            if _is_int(number):
                key = number
            else:
                key = ("layer", self._next_ordinal)
                self._next_ordinal += 1
            self._keys[module] = key
        return key

    def _ensure_patched(self, cls: type) -> None:
        if cls not in self.patched:
            self._patch_forward(cls)
            self.patched.append(cls)

    # -- the wrapped forward ----------------------------------------------------------------------

    def layer_forward(self, original: Callable, module: torch.nn.Module, *args, **kwargs):
        if not self.recording or self._depth:
            return original(module, *args, **kwargs)
        if not torch.is_grad_enabled():
            # Inside a checkpoint's forward (no_grad: this layer saves nothing). The checkpoint's
            # inputs, saved when its forward returns, belong to the first layer it runs.
            frame = self._frames[-1] if self._frames else None
            if frame is not None and frame.layer is None:
                frame.layer = self.key_of(module)
                frame.scope.enter_context(self.offloader.layer(frame.layer))
            return original(module, *args, **kwargs)
        self._depth += 1
        try:
            with self.offloader.layer(self.key_of(module)):
                return original(module, *args, **kwargs)
        finally:
            self._depth -= 1

    # -- checkpoints -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def checkpoint_frame(self):
        """Around ``CheckpointFunction.apply``: autograd packs what forward saved just before
        apply returns, so a layer scope opened during forward must last until then."""
        if not self.recording:
            yield
            return
        frame = _CheckpointFrame()
        self._frames.append(frame)
        try:
            with frame.scope:
                yield
        finally:
            self._frames.pop()


class DeepSpeedCheckpointSettings:
    """Reads DeepSpeed's activation-checkpointing flags (module globals of
    ``deepspeed.runtime.activation_checkpointing.checkpointing``) when a checkpoint runs."""

    def __init__(self, checkpointing_module) -> None:
        self._m = checkpointing_module
        self._warned = False

    @property
    def partition_activations(self) -> bool:
        return bool(getattr(self._m, "PARTITION_ACTIVATIONS", False))

    @property
    def cpu_checkpointing(self) -> bool:
        return bool(getattr(self._m, "CPU_CHECKPOINT", False))

    @property
    def contiguous(self) -> bool:
        return bool(getattr(self._m, "CONTIGUOUS_CHECKPOINTING", False))

    def warn_contiguous(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning("ssdtrain: DeepSpeed activation checkpointing has "
                        "contiguous_memory_optimization on: checkpoint inputs are copied into "
                        "preallocated buffers that stay allocated until backward, so offloading "
                        "them would free nothing; they stay in memory (other activations are "
                        "still offloaded). Set activation_checkpointing."
                        "contiguous_memory_optimization (--contigious-checkpointing) to false to "
                        "offload them.")


def route_saved_inputs(ctx, settings: DeepSpeedCheckpointSettings) -> bool:
    """Move what DeepSpeed's CheckpointFunction.forward kept for backward in
    ``ctx.deepspeed_saved_tensors`` into ``ctx.save_for_backward`` (see the module docstring).
    Returns whether anything was routed; :func:`restore_saved_inputs` undoes it in backward."""
    if not hasattr(ctx, "deepspeed_saved_tensors"):
        raise RuntimeError(
            "ssdtrain: this DeepSpeed's CheckpointFunction does not keep its inputs in "
            "ctx.deepspeed_saved_tensors, which the offload patch relies on (written against "
            "DeepSpeed 0.19); run without --ssd-offload or use a supported DeepSpeed")
    if settings.contiguous:
        settings.warn_contiguous()
        return False
    saved = list(ctx.deepspeed_saved_tensors)
    own_copies = settings.partition_activations or settings.cpu_checkpointing
    slots: List[Tuple[int, bool]] = []  # (index in saved, True: its saved_data attribute)
    tensors: List[torch.Tensor] = []
    for i, t in enumerate(saved):
        data = getattr(t, "saved_data", None)
        if isinstance(data, torch.Tensor):
            # An emptied input; DeepSpeed's backward restores it from saved_data. The input object
            # stays in ctx (Python attributes do not survive a pack/unpack round trip).
            slots.append((i, True))
            tensors.append(data)
            t.saved_data = None
        elif not own_copies and isinstance(t, torch.Tensor):
            slots.append((i, False))
            tensors.append(t)
            saved[i] = None
    if not slots:
        return False
    ctx.save_for_backward(*tensors)
    ctx.deepspeed_saved_tensors = tuple(saved)
    ctx.ssdtrain_slots = slots
    return True


def restore_saved_inputs(ctx) -> None:
    """Backward: put the routed tensors back where DeepSpeed's backward looks for them."""
    slots = getattr(ctx, "ssdtrain_slots", None)
    if not slots:
        return
    restored = ctx.saved_tensors  # the offloader's unpack hook reads them back here
    saved = list(ctx.deepspeed_saved_tensors)
    for (i, is_saved_data), t in zip(slots, restored):
        if is_saved_data:
            saved[i].saved_data = t
        else:
            saved[i] = t
    ctx.deepspeed_saved_tensors = tuple(saved)
    ctx.ssdtrain_slots = None


def offloading_checkpoint_function(base: type, scopes: LayerScopes,
                                   settings: DeepSpeedCheckpointSettings) -> type:
    """A subclass of DeepSpeed's ``CheckpointFunction`` (``base``) whose saved inputs go through
    the offloader in recorded forwards; DeepSpeed's own forward and backward do all the work."""

    class OffloadingCheckpointFunction(base):
        """deepspeed.checkpointing.CheckpointFunction, with its saved inputs offloaded
        (installed by ssdtrain_megatron.megatron.deepspeed)."""

        @classmethod
        def apply(cls, *args):
            with scopes.checkpoint_frame():
                return super().apply(*args)

        @staticmethod
        def forward(ctx, run_function, all_outputs, *args):
            outputs = base.forward(ctx, run_function, all_outputs, *args)
            if scopes.recording and route_saved_inputs(ctx, settings):
                scopes.checkpoints_routed += 1
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            restore_saved_inputs(ctx)
            return base.backward(ctx, *grads)

    OffloadingCheckpointFunction.__qualname__ = f"Offloading{base.__qualname__}"
    OffloadingCheckpointFunction.__module__ = __name__
    return OffloadingCheckpointFunction


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
