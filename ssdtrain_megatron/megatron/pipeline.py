"""Micro-batch identity, backward hints and step boundaries from megatron's pipeline schedules.

megatron-core 0.16-0.19 run every micro-batch through ``schedules.forward_step`` and
``schedules.backward_step`` (0.17+: ``backward_step_multimodule`` for multi-module 1F1B) in all
three schedules (no pipelining, 1F1B, interleaved), and the training loop gets the schedule from
``get_forward_backward_func()``. The wrappers here:

* ``forward_step``: records the micro-batch's forward under ``offloader.microbatch((chunk,
  micro-batch))`` (chunk: the virtual pipeline stage, 0 without one) and remembers which output
  tensor belongs to which micro-batch;
* ``backward_step`` (each backward function of the release): finds the micro-batch from that
  output tensor and tells the offloader its backward is next (``begin_backward``), unless a
  prediction already did;
* after each forward and backward, :class:`~.schedule.BackwardOrder` predicts whose backward
  follows, so reads start while the pipeline communicates;
* the function ``get_forward_backward_func()`` returns ends the step (``offloader.end_step()``)
  once every micro-batch is done; ``offloader.last_step_stats`` then holds its StepStats, and
  :func:`~.telemetry.publish_step` sends them to Megatron's TensorBoard writer and log.

Only steps started through that function are recorded; ``forward_only`` steps (evaluation)
are not, and neither is anything outside ``forward_step``. A step whose model config turns on
megatron-core's own activation offloading (``cpu_offloading``,
``fine_grained_activation_offloading``) or megatron's CUDA graphs (``cuda_graph_impl``,
``enable_cuda_graph``, ``external_cuda_graph``) is refused before it starts (:mod:`.compat`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Set, Tuple

import torch

from . import compat
from .schedule import BackwardOrder
from .scopes import LayerScopes, unscoped_layers
from .telemetry import publish_step

log = logging.getLogger(__name__)

NO_PIPELINING = "no_pipelining"
ONE_F_ONE_B = "1f1b"
INTERLEAVED = "interleaved"


@dataclass
class _Step:
    """What one offloaded forward-backward call has seen so far."""

    order: Optional[BackwardOrder]
    forwards_done: int = 0
    backwards_done: int = 0
    predicted: Optional[Hashable] = None  # the backward we announced as next
    hinted: Set[Hashable] = field(default_factory=set)
    outputs: Dict[int, Tuple[torch.Tensor, Hashable]] = field(default_factory=dict)
    unnamed: Dict[int, int] = field(default_factory=dict)  # chunk -> forwards without an id


class PipelineHooks:
    """State and logic behind the patched schedule functions.

    Args:
        offloader: the installed ActivationOffloader.
        scopes: the layer scopes (told when a micro-batch forward is being recorded).
        forward_step: the original ``schedules.forward_step``.
        backward_steps: name -> original schedule function running one micro-batch backward
            (``backward_step``; 0.17+ also ``backward_step_multimodule``).
        schedule_kinds: original forward-backward function -> NO_PIPELINING / ONE_F_ONE_B /
            INTERLEAVED, for the backward-order prediction.
    """

    def __init__(self, offloader, scopes: LayerScopes, forward_step: Callable,
                 backward_steps: Dict[str, Callable], schedule_kinds: Dict[Callable, str]) -> None:
        self.offloader = offloader
        self.scopes = scopes
        self._forward_step = forward_step
        self._forward_sig = inspect.signature(forward_step)
        self._backward_steps = {name: (fn, inspect.signature(fn))
                                for name, fn in backward_steps.items()}
        self._kinds = schedule_kinds
        self._models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self.step: Optional[_Step] = None
        self.active = True
        """False after uninstall(): functions handed out earlier then run megatron's own."""
        self.mispredictions = 0
        """Backwards that did not follow the prediction (all steps; 0 when the schedule model
        matches megatron's schedule)."""
        self.steps_predicted = 0
        """Steps for which the backward order was predicted."""

    # -- get_forward_backward_func ----------------------------------------------------------

    def wrap_forward_backward(self, fb: Callable) -> Callable:
        """The function get_forward_backward_func() returns while installed."""
        hooks = self
        kind = self._kinds.get(fb)

        @functools.wraps(fb)
        def offloaded_forward_backward(*args, **kwargs):
            if not hooks.active:
                return fb(*args, **kwargs)
            return hooks.run_step(fb, kind, args, kwargs)

        return offloaded_forward_backward

    def run_step(self, fb: Callable, kind: Optional[str], args: tuple, kwargs: Dict[str, Any]):
        if self.step is not None or kwargs.get("forward_only", False):
            return fb(*args, **kwargs)
        self._refuse_megatron_offloading(kwargs.get("model"))
        order = self._backward_order(kind, kwargs)
        self.steps_predicted += order is not None
        self.step = _Step(order=order)
        try:
            result = fb(*args, **kwargs)
        finally:
            # On an exception the step is abandoned: the records stay with the offloader until
            # its next end_step() or close().
            self.step = None
            self.scopes.recording = False
        publish_step(self.offloader.end_step())  # TensorBoard and log, where Megatron has them
        return result

    @staticmethod
    def _refuse_megatron_offloading(model) -> None:
        if model is None:
            return
        from megatron.core.utils import get_model_config

        chunks = model if isinstance(model, list) else [model]
        config = get_model_config(chunks[0])
        compat.refuse_megatron_offloading(config)
        compat.refuse_cuda_graphs(config)

    def _backward_order(self, kind: Optional[str], kwargs: Dict[str, Any]) -> Optional[BackwardOrder]:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.utils import get_model_config

        model = kwargs.get("model")
        num_microbatches = kwargs.get("num_microbatches")
        if kind is None or model is None or not isinstance(num_microbatches, int):
            return None
        chunks = model if isinstance(model, list) else [model]
        config = get_model_config(chunks[0])
        if getattr(config, "overlap_moe_expert_parallel_comm", False) or \
                getattr(config, "hybrid_context_parallel", False):
            return None  # combined / hybrid schedules: their own order
        if kind == NO_PIPELINING:
            return BackwardOrder.one_chunk(num_microbatches, 0)
        p2p = kwargs.get("p2p_communicator")
        if p2p is not None:
            position = compat.pipeline_position(p2p)
            if position is None:
                return None
            pp_size, pp_rank = position
        else:
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if kind == ONE_F_ONE_B:
            return BackwardOrder.one_chunk(num_microbatches, pp_size - pp_rank - 1)
        group = config.microbatch_group_size_per_vp_stage
        _, _, num_warmup, _ = schedules.get_pp_rank_microbatches(
            num_microbatches, len(chunks), group, forward_only=False,
            overlap_moe_expert_parallel_comm=False, p2p_communicator=p2p)
        table = schedules.get_schedule_table(num_microbatches, len(chunks), group)
        return BackwardOrder.interleaved(table, len(chunks), num_warmup)

    # -- forward_step / backward_step -------------------------------------------------------

    def forward_step(self, *args, **kwargs):
        step = self.step
        if step is None or self.scopes.recording:
            return self._forward_step(*args, **kwargs)
        bound = self._forward_sig.bind(*args, **kwargs).arguments
        self._register_parameters(bound.get("model"))
        # The stage's received input: the schedule keeps it in input_tensors until this
        # micro-batch's backward, so the first layer's saved input (and a checkpoint's) is in
        # memory anyway; writing it would spend bandwidth and free nothing.
        self.offloader.register_held(_tensors(bound.get("input_tensor")))
        chunk = bound.get("vp_stage") or 0
        microbatch = bound.get("current_microbatch")
        if microbatch is None:
            microbatch = step.unnamed.get(chunk, 0)
            step.unnamed[chunk] = microbatch + 1
        key = (chunk, microbatch)
        self.scopes.recording = True
        try:
            with self.offloader.microbatch(key):
                result = self._forward_step(*args, **kwargs)
        finally:
            self.scopes.recording = False
        output = _first_tensor(result[0] if isinstance(result, tuple) else result)
        if output is not None:
            step.outputs[id(output)] = (output, key)
        step.forwards_done += 1
        if step.order is not None:
            self._announce(step, step.order.after_forward(step.forwards_done))
        return result

    def backward_hook(self, name: str) -> Callable:
        """The hook for the schedule's backward function ``name``."""
        return functools.partial(self.backward_step, name)

    def backward_step(self, name: str, *args, **kwargs):
        original, signature = self._backward_steps[name]
        step = self.step
        if step is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        output = _first_tensor(bound.get("output_tensor"))
        entry = step.outputs.pop(id(output), None) if output is not None else None
        if entry is not None:
            key = entry[1]
            if step.order is not None and step.predicted != key:
                self.mispredictions += 1
                log.debug("ssdtrain: backward of %s, predicted %s", key, step.predicted)
            self._announce(step, key)
        step.predicted = None
        result = original(*args, **kwargs)
        step.backwards_done += 1
        if step.order is not None:
            self._announce(step, step.order.after_backward(step.backwards_done))
        return result

    def _announce(self, step: _Step, key: Optional[Hashable]) -> None:
        if key is None:
            return
        step.predicted = key
        if key not in step.hinted:
            step.hinted.add(key)
            self.offloader.begin_backward(key)

    def _register_parameters(self, model) -> None:
        if isinstance(model, torch.nn.Module) and model not in self._models:
            self._models.add(model)
            self.offloader.register_parameters(model.parameters())
            # Layers whose class bypasses the patched forward save outside any layer scope:
            # the offloader's watch names them if they do (cache/silence.py).
            self.offloader.watch.expect_layers(unscoped_layers(model))


def _tensors(obj) -> List[torch.Tensor]:
    """The tensors in a schedule argument: a tensor, a list of them (None for a first stage),
    or a dict of them (multi-module pipelines, 0.17+)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []


def _first_tensor(obj) -> Optional[torch.Tensor]:
    if isinstance(obj, dict):  # multi-module pipelines (0.17+): module name -> tensor
        obj = next(iter(obj.values()), None)
    if isinstance(obj, (list, tuple)):
        obj = obj[0] if obj else None
    return obj if isinstance(obj, torch.Tensor) else None
