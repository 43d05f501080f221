"""Micro-batches, backward hints and step boundaries from DeepSpeed's engines.

Used by :mod:`ssdtrain_megatron.megatron.deepspeed` (the only module that imports deepspeed: the
DeepSpeed classes arrive here as arguments).

**PipelineEngine.** ``train_batch()`` runs one step as an instruction schedule
(``_exec_schedule``): micro-batches live in pipeline buffers, named by ``buffer_id`` (and, in
DualPipeV, a ``phase``); a buffer is reused once its micro-batch's backward is done. The hooks:

* ``train_batch``: the step; ``offloader.end_step()`` when it returns;
* each forward registers what ``pipe_buffers`` holds until backward (stage inputs, labels) as
  held by the schedule (``offloader.register_held``): saved, those pass through unwritten;
* ``_exec_schedule``: reads the whole schedule before it runs (DeepSpeed's schedules are plain
  generators of instruction lists) into a :class:`SchedulePlan`, then runs that same list;
* the ``ForwardPass`` / ``BackwardPass`` entries of the engine's ``_INSTRUCTION_MAP``: a forward
  runs inside ``offloader.microbatch(key)``, where ``key`` is the micro-batch index (the n-th
  forward of the step, per phase: ``n``, or ``(phase, n)`` in DualPipeV); a backward finds its
  key from the buffer it names. Right after each forward or backward, when the next compute
  instruction of the schedule is a backward, ``offloader.begin_backward(its key)`` starts its
  reads, so they overlap the communication (RecvGrad, SendActivation) that comes first.

**DeepSpeedEngine** (no pipeline): ``forward()`` runs inside ``offloader.microbatch(n)``,
``backward()`` hints the backward of the latest micro-batch whose backward has not run, and
``step()`` ends the offloader's step when it was a gradient-accumulation boundary (the engine's
``global_steps`` advanced). A PipelineEngine's own calls into these (its ``forward`` and its last
stage's ``backward``) are left to the instruction hooks.

Only training is recorded: PipelineEngine instructions outside ``train_batch`` (``eval_batch``)
and engine forwards with grad disabled or the module in eval mode pass through untouched.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch

from .ds_checkpoint import LayerScopes
from .telemetry import publish_step

log = logging.getLogger(__name__)

FORWARD = "F"
BACKWARD = "B"


def _buffer_of(kwargs: Dict[str, Any]) -> Tuple[Optional[int], int]:
    """(phase, buffer_id) of a ForwardPass / BackwardPass instruction's kwargs."""
    return kwargs.get("phase"), kwargs["buffer_id"]


class SchedulePlan:
    """The compute instructions of one step's schedule, their micro-batch keys, and which
    backward to announce after each of them.

    Args:
        steps: the schedule, as DeepSpeed yields it (a list of instruction lists).
        forward_cls, backward_cls: DeepSpeed's ``ForwardPass`` and ``BackwardPass`` classes.
    """

    def __init__(self, steps: Iterable[Sequence[Any]], forward_cls: type,
                 backward_cls: type) -> None:
        self.compute: List[Tuple[str, Hashable]] = []  # (FORWARD/BACKWARD, key), in order
        self._bindings = _Bindings()
        for cmds in steps:
            for cmd in cmds:
                if isinstance(cmd, forward_cls):
                    self.compute.append((FORWARD, self._bindings.forward(cmd.kwargs)))
                elif isinstance(cmd, backward_cls):
                    self.compute.append((BACKWARD, self._bindings.backward(cmd.kwargs)))
        self._runtime = _Bindings()
        self.cursor = 0
        self.valid = True
        """False once the engine ran something the plan did not foresee (no more hints)."""

    def hint_at_start(self) -> Optional[Hashable]:
        """A backward to announce before anything runs (a schedule that starts with one)."""
        return self._next_backward()

    def forward_started(self, kwargs: Dict[str, Any]) -> Hashable:
        key = self._runtime.forward(kwargs)
        self._advance(FORWARD, key)
        return key

    def backward_started(self, kwargs: Dict[str, Any]) -> Optional[Hashable]:
        key = self._runtime.backward(kwargs)
        self._advance(BACKWARD, key)
        return key

    def after_compute(self) -> Optional[Hashable]:
        """The key of the backward that comes next, when the next compute instruction is one."""
        return self._next_backward()

    def _advance(self, kind: str, key: Hashable) -> None:
        expected = self.compute[self.cursor] if self.cursor < len(self.compute) else None
        if self.valid and expected != (kind, key):
            log.debug("ssdtrain: instruction %s%s does not follow the schedule read before the "
                      "step; no further backward hints this step", kind, key)
            self.valid = False
        self.cursor += 1

    def _next_backward(self) -> Optional[Hashable]:
        if self.valid and self.cursor < len(self.compute):
            kind, key = self.compute[self.cursor]
            if kind == BACKWARD:
                return key
        return None


class _Bindings:
    """Micro-batch keys: the n-th forward of a phase is micro-batch n; a buffer holds the
    micro-batch last forwarded into it until that micro-batch's backward."""

    def __init__(self) -> None:
        self.forwards: Dict[Optional[int], int] = {}
        self.buffers: Dict[Tuple[Optional[int], int], Hashable] = {}

    def forward(self, kwargs: Dict[str, Any]) -> Hashable:
        phase, buffer_id = _buffer_of(kwargs)
        n = self.forwards.get(phase, 0)
        self.forwards[phase] = n + 1
        key = n if phase is None else (phase, n)
        self.buffers[(phase, buffer_id)] = key
        return key

    def backward(self, kwargs: Dict[str, Any]) -> Optional[Hashable]:
        return self.buffers.pop(_buffer_of(kwargs), None)


class _Replay:
    """The schedule ``_exec_schedule`` was given, with its steps already read into a list."""

    def __init__(self, schedule: Any, steps: List[List[Any]]) -> None:
        self._schedule = schedule
        self._steps = steps

    def __iter__(self):
        return iter(self._steps)

    def __getattr__(self, name: str) -> Any:  # num_pipe_buffers() and anything else
        return getattr(self._schedule, name)


@dataclass
class _PipelineStep:
    engine: Any
    plan: Optional[SchedulePlan] = None
    hinted: set = field(default_factory=set)


@dataclass
class _EngineStep:
    forwards: int = 0
    pending: List[Hashable] = field(default_factory=list)  # forwards whose backward has not run


class EngineHooks:
    """State and logic behind the patched DeepSpeed engine methods and instructions.

    Args:
        offloader: the installed ActivationOffloader.
        scopes: the layer scopes (told when a micro-batch forward is being recorded).
        pipeline_engine_cls: DeepSpeed's ``PipelineEngine``.
        forward_cls, backward_cls: DeepSpeed's ``ForwardPass`` and ``BackwardPass`` instructions.
        non_reentrant_checkpoint: ``deepspeed.checkpointing.non_reentrant_checkpoint`` (a model
            that uses it gets a warning: its inputs cannot be offloaded).
    """

    def __init__(self, offloader, scopes: LayerScopes, pipeline_engine_cls: type,
                 forward_cls: type, backward_cls: type,
                 non_reentrant_checkpoint: Optional[Callable] = None) -> None:
        self.offloader = offloader
        self.scopes = scopes
        self._pipeline_cls = pipeline_engine_cls
        self.forward_cls = forward_cls
        self.backward_cls = backward_cls
        self._non_reentrant = non_reentrant_checkpoint
        self.active = True
        """False after uninstall(): anything still holding a wrapper runs DeepSpeed's own."""
        self.step: Optional[_PipelineStep] = None
        self._engine_steps: "weakref.WeakKeyDictionary[Any, _EngineStep]" = \
            weakref.WeakKeyDictionary()
        self._models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self.hints: List[Hashable] = []
        """Backwards announced by a schedule hint before they ran, in order (the last
        train_batch step only)."""
        self.mispredictions = 0
        """Backwards that ran without their hint (0 when the plan matches the schedule)."""
        self.steps_planned = 0
        """train_batch steps whose schedule was read ahead."""

    # -- PipelineEngine ---------------------------------------------------------------------------

    def train_batch(self, original: Callable, engine, *args, **kwargs):
        if not self.active or self.step is not None:
            return original(engine, *args, **kwargs)
        self.step = _PipelineStep(engine)
        self.hints = []
        try:
            result = original(engine, *args, **kwargs)
        finally:
            # On an exception the step is abandoned: its records stay with the offloader until
            # its next end_step() or close().
            self.step = None
            self.scopes.recording = False
        publish_step(self.offloader.end_step())
        return result

    def exec_schedule(self, original: Callable, engine, pipe_schedule, *args, **kwargs):
        step = self.step
        if step is None or step.engine is not engine or step.plan is not None:
            return original(engine, pipe_schedule, *args, **kwargs)
        steps = [list(cmds) for cmds in pipe_schedule]
        step.plan = SchedulePlan(steps, self.forward_cls, self.backward_cls)
        self.steps_planned += 1
        self._hint(step, step.plan.hint_at_start())
        return original(engine, _Replay(pipe_schedule, steps), *args, **kwargs)

    def forward_pass(self, original: Callable, engine, **kwargs):
        step = self._pipeline_step(engine)
        if step is None:
            return original(engine, **kwargs)
        key = step.plan.forward_started(kwargs)
        self._prepare(engine)
        self._register_pipe_buffers(engine)
        self.scopes.recording = True
        try:
            with self.offloader.microbatch(key):
                result = original(engine, **kwargs)
        finally:
            self.scopes.recording = False
        self._hint(step, step.plan.after_compute())
        return result

    def backward_pass(self, original: Callable, engine, **kwargs):
        step = self._pipeline_step(engine)
        if step is None:
            return original(engine, **kwargs)
        key = step.plan.backward_started(kwargs)
        if key is not None and key not in step.hinted:
            self.mispredictions += 1
            step.hinted.add(key)
            self.offloader.begin_backward(key)
        result = original(engine, **kwargs)
        self._hint(step, step.plan.after_compute())
        return result

    def _pipeline_step(self, engine) -> Optional[_PipelineStep]:
        step = self.step
        if not self.active or step is None or step.engine is not engine or step.plan is None:
            return None
        return step

    def _hint(self, step: _PipelineStep, key: Optional[Hashable]) -> None:
        if key is not None and key not in step.hinted:
            step.hinted.add(key)
            self.hints.append(key)
            self.offloader.begin_backward(key)

    # -- DeepSpeedEngine (no pipeline) ------------------------------------------------------------

    def engine_forward(self, original: Callable, engine, *args, **kwargs):
        if self.scopes.recording and self._pipeline_step(engine) is not None:
            # A PipelineEngine's ForwardPass calls this: a partitioned stage input has been
            # rebuilt (``full()``) and put into pipe_buffers since forward_pass registered them.
            self._register_pipe_buffers(engine)
        if (not self.active or isinstance(engine, self._pipeline_cls) or self.scopes.recording
                or not torch.is_grad_enabled() or not getattr(engine.module, "training", True)):
            return original(engine, *args, **kwargs)
        state = self._engine_steps.get(engine)
        if state is None:
            state = self._engine_steps[engine] = _EngineStep()
        key = state.forwards
        state.forwards += 1
        self._prepare(engine)
        self.scopes.recording = True
        try:
            with self.offloader.microbatch(key):
                result = original(engine, *args, **kwargs)
        finally:
            self.scopes.recording = False
        state.pending.append(key)
        return result

    def engine_backward(self, original: Callable, engine, *args, **kwargs):
        if self.active and not isinstance(engine, self._pipeline_cls):
            state = self._engine_steps.get(engine)
            if state is not None and state.pending:
                self.offloader.begin_backward(state.pending.pop())
        return original(engine, *args, **kwargs)

    def engine_step(self, original: Callable, engine, *args, **kwargs):
        if not self.active or isinstance(engine, self._pipeline_cls):
            return original(engine, *args, **kwargs)
        before = getattr(engine, "global_steps", None)
        result = original(engine, *args, **kwargs)
        if getattr(engine, "global_steps", None) != before and engine in self._engine_steps:
            del self._engine_steps[engine]
            publish_step(self.offloader.end_step())
        return result

    # -- both ------------------------------------------------------------------------------------

    def _register_pipe_buffers(self, engine) -> None:
        """A PipelineEngine keeps each micro-batch's stage input and labels in ``pipe_buffers``
        until that micro-batch's backward: a saved tensor on them frees nothing when written,
        so they are registered as held (they pass through as ``held_by_schedule``). DeepSpeed
        clones a received input before the forward, so what this catches is labels a loss
        function saves (cross entropy's target) and a partitioned stage input, rebuilt by
        ``full()`` (also a leaf that needs its gradient, which passes through as such)."""
        buffers = getattr(engine, "pipe_buffers", None)
        if not isinstance(buffers, dict):
            return
        for name in ("inputs", "labels"):
            for entry in buffers.get(name, ()):
                self.offloader.register_held(_tensors(entry))

    def _prepare(self, engine) -> None:
        """First recorded forward of a model: its parameters are never offloaded, its named
        layer classes get their scopes."""
        model = getattr(engine, "module", None)
        if not isinstance(model, torch.nn.Module) or model in self._models:
            return
        self._models.add(model)
        device = getattr(engine, "device", None)
        if device is not None and torch.device(device) != self.offloader.device:
            log.warning("ssdtrain: this DeepSpeed engine trains on %s but the offloader was "
                        "installed for %s, so none of its activations will be offloaded; call "
                        "install() after the device is selected (torch.cuda.set_device, "
                        "deepspeed.init_distributed)", device, self.offloader.device)
        self.offloader.register_parameters(model.parameters())
        self.scopes.discover(model)
        if (self._non_reentrant is not None and getattr(model, "activation_checkpoint_interval", 0)
                and getattr(model, "activation_checkpoint_func", None) is self._non_reentrant):
            log.warning("ssdtrain: this PipelineModule checkpoints with DeepSpeed's "
                        "non_reentrant_checkpoint, which keeps its inputs in a closure and its "
                        "saved tensors under its own hooks: nothing inside its checkpoints is "
                        "offloaded. Use the reentrant checkpoint (pipeline.use_reentrant: true) "
                        "to offload checkpoint inputs.")


def _tensors(obj) -> List[torch.Tensor]:
    """The tensors in a pipe buffer entry: a tensor, a tuple or list of them, or None."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []
