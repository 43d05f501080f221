"""Layer scopes: which transformer layer a saved activation belongs to, and recompute fallback.

``TransformerLayer.forward`` runs inside ``offloader.layer(layer.layer_number)``; the layer
number is megatron's global one (it already includes the pipeline and virtual-pipeline offset),
so keys sort in forward order on every rank and per-layer statistics name real layers.

Scopes are entered only while a micro-batch's forward is being recorded (inside the patched
``forward_step`` of an offloaded step) and autograd records the graph. Two cases therefore get
no layer scope of their own, on purpose:

* layers run by megatron's full recomputation inside ``CheckpointFunction.forward`` (under
  ``no_grad``: they save nothing). What that checkpoint saves are its inputs; the
  ``tensor_parallel.checkpoint`` wrapper puts them in the scope of the first layer the
  checkpoint covers, found through the block's own layer list (the full-recompute driver,
  ``TransformerBlock._checkpointed_forward`` or from 0.18 ``megatron.core.recompute.
  checkpointed_forward(block, ...)``, is wrapped to say which block is running and how many of
  its layers ran so far);
* the recompute pass during backward (outside any forward_step): the offloader keeps what it
  saves in memory. Each layer it runs again is timed under ``offloader.layer`` all the same
  (StepStats.layers ``recompute_s``: what recomputing the layer costs, which the adaptive
  planner prices recompute with).

A checkpoint's first forward runs under ``no_grad``, and yet saves tensors where the function
turns grad on for a moment: megatron-core's ``TransformerLayer`` runs every bias-dropout-add
under ``torch.enable_grad()`` (``bias_dropout_add_exec_handler``), so its dropout saves its
mask there. That graph ends inside the checkpoint (its outputs get the checkpoint's own
``grad_fn``) and is freed before any backward: written, those tensors would be released
unread. Every checkpoint run while a micro-batch forward is recorded (megatron's full and
selective recomputation, and the recompute fallback's) therefore runs its function's first
forward inside ``offloader.discarded_graph()``, which leaves them to autograd.

Recompute fallback: a layer the plan marks ``recompute`` (the static ``recompute_layers``, or
the adaptive planner with ``recompute_fallback`` on) runs under megatron's own
``tensor_parallel.checkpoint``, inside a scope with decision ``recompute``, so only its inputs
are saved (and offloaded) and the rest is recomputed in backward.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch


class LayerScopes:
    """Per-install state and logic behind the patched layer, block and checkpoint functions.

    Args:
        offloader: the installed ActivationOffloader.
        recompute_layers: layer numbers run under checkpoint (recompute fallback); empty: none.
        layer_forward: the original ``TransformerLayer.forward``.
        block_checkpointed_forward: the original full-recompute driver, called as
            ``(block, *args, **kwargs)`` (see :mod:`.compat`).
        checkpoint: the original ``tensor_parallel.checkpoint``.
    """

    def __init__(self, offloader, recompute_layers: FrozenSet[int], layer_forward: Callable,
                 block_checkpointed_forward: Callable, checkpoint: Callable) -> None:
        self.offloader = offloader
        self.recompute_layers = recompute_layers
        self._layer_forward = layer_forward
        self._block_checkpointed_forward = block_checkpointed_forward
        self._checkpoint = checkpoint
        self.recording = False
        """True while a micro-batch forward of an offloaded step runs (set by the pipeline)."""
        self._layer_depth = 0
        self._block: Optional[Any] = None  # TransformerBlock inside _checkpointed_forward
        self._block_layers_run = 0
        self.fallback_layers_run = 0
        """Layer forwards run under checkpoint by the recompute fallback (all steps)."""

    def _scoped(self) -> bool:
        return self.recording and torch.is_grad_enabled()

    # -- TransformerLayer.forward --------------------------------------------------------------

    def layer_forward(self, layer, *args, **kwargs):
        if self._block is not None and self.recording:
            self._block_layers_run += 1
        if not self._scoped() or self._layer_depth:
            if not self._layer_depth and torch._C._current_graph_task_id() != -1:
                return self.recompute_pass(layer.layer_number, self._layer_forward, layer, *args, **kwargs)
            return self._layer_forward(layer, *args, **kwargs)
        key = layer.layer_number
        # The static plan (recompute_layers) or the adaptive planner's decision for this layer.
        recompute = self._block is None and (
            key in self.recompute_layers
            or (self.offloader.config.recompute_fallback and self.offloader.decision_for(key) == "recompute"))
        self._layer_depth += 1
        try:
            with self.offloader.layer(key, decision="recompute" if recompute else None):
                if recompute:
                    self.fallback_layers_run += 1
                    return self._checkpointed_layer(layer, args, kwargs)
                return self._layer_forward(layer, *args, **kwargs)
        finally:
            self._layer_depth -= 1

    def recompute_pass(self, key, function: Callable, *args, **kwargs):
        """``function`` run again by a checkpoint's backward, as layer ``key``'s recompute
        pass (the offloader times it; what it saves stays in memory)."""
        self._layer_depth += 1
        try:
            with self.offloader.layer(key):
                return function(*args, **kwargs)
        finally:
            self._layer_depth -= 1

    def _checkpointed_layer(self, layer, args: tuple, kwargs: Dict[str, Any]):
        """Run ``layer`` under megatron's ``tensor_parallel.checkpoint``.

        CheckpointFunction takes positional tensors only, so every tensor argument (positional
        or keyword, or inside a tuple or list such as megatron-core 0.19's two RoPE tensors)
        travels through it (they are what it saves, and gradients reach the ones that need
        them); everything else is bound in the run function.
        """
        values: List[Any] = list(args) + list(kwargs.values())
        names = list(kwargs.keys())
        n_args = len(args)
        slots: List[Tuple[int, Optional[int]]] = []  # (argument, position in a sequence or None)
        tensors: List[torch.Tensor] = []
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                slots.append((i, None))
                tensors.append(v)
            elif isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
                items = list(v)
                for j, x in enumerate(items):
                    if isinstance(x, torch.Tensor):
                        slots.append((i, j))
                        tensors.append(x)
                        items[j] = None
                values[i] = type(v)(items) if isinstance(v, tuple) else items
                continue
            else:
                continue
            values[i] = None  # ctx.run_function lives until backward: hold no activations
        run = _LayerCall(self._layer_forward, layer, values, names, n_args, slots)
        # distribute_saved_activations=False: the input stays whole on every TP rank (it is
        # what gets offloaded, per rank, to that rank's own directory).
        if self.offloader is not None:  # its first forward's graph is discarded (module docstring)
            run = _DiscardingForward(run, self.offloader, self, layer.layer_number)
        return self._checkpoint(run, False, *tensors)

    # -- TransformerBlock._checkpointed_forward (megatron's full recomputation) ---------------

    def block_checkpointed_forward(self, block, *args, **kwargs):
        if not self.recording:
            return self._block_checkpointed_forward(block, *args, **kwargs)
        outer = (self._block, self._block_layers_run)
        self._block, self._block_layers_run = block, 0
        try:
            return self._block_checkpointed_forward(block, *args, **kwargs)
        finally:
            self._block, self._block_layers_run = outer

    # -- tensor_parallel.checkpoint -------------------------------------------------------------

    def checkpoint(self, function, distribute_saved_activations, *args):
        block = self._block
        if self.recording:  # what the first forward saves is dropped with its graph
            function = _DiscardingForward(function, self.offloader)
        if (not self._scoped() or self._layer_depth or block is None
                or self._block_layers_run >= len(block.layers)):
            # Inside a layer (selective recompute: its scope already applies), or not
            # recording: nothing to attribute.
            return self._checkpoint(function, distribute_saved_activations, *args)
        first_layer = block.layers[self._block_layers_run]
        with self.offloader.layer(first_layer.layer_number):
            return self._checkpoint(function, distribute_saved_activations, *args)


def unscoped_layers(model: torch.nn.Module) -> Dict[Any, str]:
    """Layers of ``model`` (the entries of a block's ``layers`` list that have a
    ``layer_number``) whose class's forward is not the patched ``TransformerLayer.forward``:
    layer number -> class name. A subclass that overrides forward without calling it, or
    another layer class (a release's new one), never enters a layer scope."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    scoped = TransformerLayer.forward
    out: Dict[Any, str] = {}
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            continue
        for layer in layers:
            number = getattr(layer, "layer_number", None)
            if number is not None and type(layer).forward is not scoped:
                out[number] = f"{type(layer).__module__}.{type(layer).__qualname__}"
    return out


class _DiscardingForward:
    """A checkpoint's function whose first forward (not the recompute pass in backward) runs
    inside ``offloader.discarded_graph()``: see the module docstring. For the recompute
    fallback's one layer (``key``), the recompute pass is that layer's, timed by ``scopes``."""

    __slots__ = ("function", "offloader", "scopes", "key")

    def __init__(self, function: Callable, offloader, scopes: Optional["LayerScopes"] = None,
                 key: Any = None) -> None:
        self.function = function
        self.offloader = offloader
        self.scopes = scopes
        self.key = key

    def __call__(self, *args: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:  # the recompute pass: its graph is used
            if self.scopes is not None:
                return self.scopes.recompute_pass(self.key, self.function, *args)
            return self.function(*args)
        with self.offloader.discarded_graph():
            return self.function(*args)


class _LayerCall:
    """The run function of a fallback checkpoint: rebuilds the layer's call from the tensors
    CheckpointFunction passes (the originals in forward, detached copies in recompute)."""

    def __init__(self, forward: Callable, layer, values: List[Any], names: List[str],
                 n_args: int, slots: List[Tuple[int, Optional[int]]]) -> None:
        self.forward = forward
        self.layer = layer
        self.values = values
        self.names = names
        self.n_args = n_args
        self.slots = slots

    def __call__(self, *tensors: torch.Tensor) -> Tuple[Any, ...]:
        values = list(self.values)
        sequences: Dict[int, List[Any]] = {}
        for (slot, position), t in zip(self.slots, tensors):
            if position is None:
                values[slot] = t
            else:
                sequences.setdefault(slot, list(values[slot]))[position] = t
        for slot, items in sequences.items():
            values[slot] = tuple(items) if isinstance(self.values[slot], tuple) else items
        args = values[:self.n_args]
        kwargs = dict(zip(self.names, values[self.n_args:]))
        return self.forward(self.layer, *args, **kwargs)
