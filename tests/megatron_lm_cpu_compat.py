"""Test-only shims that let Megatron-LM's own ``pretrain_gpt.py`` train on a CPU-only machine.

Builds on :mod:`megatron_cpu_compat` (megatron-core's model, RNG tracker and buffers on the CPU)
and adds what Megatron-LM's training loop (``megatron.training``) assumes about CUDA:

* ``initialize_megatron`` asserts ``torch.cuda.is_available()``: it is called with
  ``allow_no_cuda=True`` instead. ``torch.cuda.is_available`` itself stays False, so everything
  that picks a device at run time (the offloader included) picks the CPU.
* ``torch.cuda.device_count()`` is 1 (Megatron only builds its model-parallel groups when it
  sees a device) and ``torch.cuda.set_device`` does nothing.
* Memory statistics (``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
  ``max_memory_reserved``, ``memory_stats``, ``reset_peak_memory_stats``, ``empty_cache``,
  ``mem_get_info``) report zeros; the numbers are not what the tests compare.
* ``get_device_properties`` / ``get_device_capability`` / ``get_device_name`` describe a
  compute capability 9.0 device (Megatron checks it when choosing defaults).
* Timers: ``torch.cuda.Event`` is a wall-clock event (``record`` / ``synchronize`` /
  ``elapsed_time`` in ms), ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` are inert.
* The C++ dataset helpers: the installed megatron-core wheel ships ``helpers_cpp`` prebuilt from
  the same ``helpers.cpp``; it is used instead of compiling one into the checkout (which would
  also need pybind11), and ``compile_helpers`` does nothing.
* ``torch.compile`` (megatron's ``jit_fuser``) is disabled: inductor would build every fusion
  with a C++ compiler on the CPU, over a minute on 2 cores, in Megatron's JIT warm-up alone.
* ``megatron.legacy.fused_kernels.load`` (nvcc builds of CUDA kernels) does nothing.
* ``megatron.core.transformer.custom_layers.batch_invariant_kernels`` imports triton at module
  level (for ``--batch-invariant-mode`` only); without triton a stand-in module is registered
  whose ``enable_batch_invariant_mode`` raises.
* ``typing.override`` (Python 3.12): the ``megatron.training`` that megatron-core 0.18+ wheels
  ship imports it; those wheels declare Requires-Python >=3.12 but run on 3.11 otherwise. On
  3.11 it is set to a decorator that does what 3.12's does at run time (marks the function
  with ``__override__ = True``, nothing else).
* ``megatron.legacy.fused_kernels`` (the nvcc kernel loader) is in Megatron-LM checkouts up to
  core_v0.16, not in core_v0.17+ nor in the wheels: it is stubbed only where it exists.

``enable(checkout)`` puts ``checkout`` first on ``sys.path`` (so ``megatron`` is the checkout's,
as when its scripts run), then installs everything; ``enable(None)`` uses the installed wheel's
``megatron.training`` (megatron-core 0.17+). ``write_sitecustomize(folder, checkout)``
writes a ``sitecustomize.py`` that does this in every torchrun worker (a process with
``LOCAL_RANK`` set) before the script runs; put ``folder`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
import types
from typing import Any, Callable, List, Optional, Tuple

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import megatron_cpu_compat  # noqa: E402

__all__ = ["enable", "disable", "is_enabled", "write_sitecustomize", "WallClockEvent"]

_MISSING = object()
_SAVED: Optional[List[Tuple[Any, str, Any]]] = None

_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
_HELPERS = "megatron.core.datasets.helpers_cpp"


class WallClockEvent:
    """torch.cuda.Event stand-in: record() takes the wall clock; elapsed_time() is in ms."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.t: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "WallClockEvent") -> float:
        return ((end.t or 0.0) - (self.t or 0.0)) * 1000.0


class _InertStream:
    """torch.cuda.Stream stand-in: work 'on' it runs on the CPU, in order."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> WallClockEvent:
        event = event or WallClockEvent()
        event.record()
        return event

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_InertStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_DEVICE_PROPERTIES = types.SimpleNamespace(
    name="CPU (megatron_lm_cpu_compat)", major=9, minor=0, total_memory=0,
    multi_processor_count=1)


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _batch_invariant_stand_in() -> types.ModuleType:
    module = types.ModuleType(_BATCH_INVARIANT)
    module.__doc__ = "Stand-in registered by tests/megatron_lm_cpu_compat.py (triton is absent)."

    def enable_batch_invariant_mode(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("--batch-invariant-mode needs triton, which this CPU test "
                           "environment does not have")

    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    module.set_batch_invariant_mode = lambda enabled=True: None
    module.disable_batch_invariant_mode = lambda: None
    module.is_batch_invariant_mode_enabled = lambda: False
    return module


def _load_wheel_helpers() -> Optional[types.ModuleType]:
    """The helpers_cpp extension of the installed megatron-core wheel, if there is one."""
    for entry in sys.path:
        folder = os.path.join(entry or ".", "megatron", "core", "datasets")
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.startswith("helpers_cpp.") and name.endswith(".so"):
                spec = importlib.util.spec_from_file_location(_HELPERS, os.path.join(folder, name))
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module
    return None


def _override(method: Callable) -> Callable:
    """typing.override as Python 3.12 runs it: marks the method, changes nothing else."""
    try:
        method.__override__ = True  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    return method


def _patch(owner: Any, name: str, value: Any) -> None:
    assert _SAVED is not None
    original = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) \
        else getattr(owner, name, _MISSING)
    _SAVED.append((owner, name, original))
    setattr(owner, name, value)


def _allow_no_cuda(initialize_megatron: Callable) -> Callable:
    def initialize_megatron_on_cpu(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    initialize_megatron_on_cpu.__wrapped__ = initialize_megatron
    return initialize_megatron_on_cpu


def is_enabled() -> bool:
    return _SAVED is not None


def enable(checkout: Optional[str] = None) -> None:
    """Install the shims (idempotent). ``checkout``: a Megatron-LM work tree to import from."""
    global _SAVED
    if _SAVED is not None:
        return
    if checkout:
        checkout = os.path.abspath(checkout)
        if checkout not in sys.path:
            sys.path.insert(0, checkout)
    if importlib.util.find_spec("triton") is None and _BATCH_INVARIANT not in sys.modules:
        sys.modules[_BATCH_INVARIANT] = _batch_invariant_stand_in()
    if _HELPERS not in sys.modules:
        helpers = _load_wheel_helpers()
        if helpers is not None:
            sys.modules[_HELPERS] = helpers

    megatron_cpu_compat.enable()
    _SAVED = []
    import typing

    if not hasattr(typing, "override"):
        _patch(typing, "override", _override)
    cuda = torch.cuda
    _patch(cuda, "device_count", lambda: 1)
    _patch(cuda, "set_device", lambda device: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        _patch(cuda, name, _zero)
    _patch(cuda, "memory_stats", lambda device=None: {})
    _patch(cuda, "reset_peak_memory_stats", lambda device=None: None)
    _patch(cuda, "reset_max_memory_allocated", lambda device=None: None)
    _patch(cuda, "empty_cache", lambda: None)
    _patch(cuda, "mem_get_info", lambda device=None: (0, 0))
    # Megatron reads the compute capability to choose defaults (e.g. whether TP needs
    # CUDA_DEVICE_MAX_CONNECTIONS=1): report a Hopper-class device, the common case.
    _patch(cuda, "get_device_properties", lambda device=None: _DEVICE_PROPERTIES)
    _patch(cuda, "get_device_capability", lambda device=None: (9, 0))
    _patch(cuda, "get_device_name", lambda device=None: _DEVICE_PROPERTIES.name)
    _patch(cuda, "Event", WallClockEvent)
    _patch(cuda, "Stream", _InertStream)
    _patch(cuda, "current_stream", lambda device=None: _InertStream())
    _patch(cuda, "default_stream", lambda device=None: _InertStream())
    _patch(cuda, "stream", lambda stream=None: contextlib.nullcontext())

    # megatron's fusions are torch.compile'd; on the CPU inductor builds them with a C++
    # compiler (Megatron's JIT warm-up alone takes over a minute on 2 cores). Run them eagerly.
    import torch._dynamo.config as dynamo_config

    _patch(dynamo_config, "disable", True)

    from megatron.core.datasets import utils as dataset_utils

    if _HELPERS in sys.modules:
        _patch(dataset_utils, "compile_helpers", lambda: None)

    if importlib.util.find_spec("megatron.legacy") is not None and \
            importlib.util.find_spec("megatron.legacy.fused_kernels") is not None:
        from megatron.legacy import fused_kernels

        # Megatron's fused kernels are CUDA sources built with nvcc; the CPU runs the unfused
        # paths.
        _patch(fused_kernels, "load", lambda args: None)

    import megatron.training.initialize as mt_initialize
    import megatron.training.training as mt_training
    import megatron.training as mt_package

    original = mt_initialize.initialize_megatron
    replacement = _allow_no_cuda(original)
    for module in (mt_initialize, mt_training, mt_package):
        if getattr(module, "initialize_megatron", None) is original:
            _patch(module, "initialize_megatron", replacement)


def disable() -> None:
    """Undo enable() (the sys.path entry and the registered modules stay)."""
    global _SAVED
    saved = _SAVED
    if saved is None:
        return
    _SAVED = None
    for owner, name, original in reversed(saved):
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    megatron_cpu_compat.disable()


_SITECUSTOMIZE = '''\
# Written by tests/megatron_lm_cpu_compat.py: CPU shims for Megatron-LM in torchrun workers.
import os
import sys

if "LOCAL_RANK" in os.environ:
    sys.path.insert(0, {tests!r})
    import megatron_lm_cpu_compat

    megatron_lm_cpu_compat.enable({checkout!r})
'''


def write_sitecustomize(folder: str, checkout: Optional[str]) -> str:
    """Write ``folder/sitecustomize.py`` enabling these shims in torchrun workers; returns it.
    ``checkout`` None: the installed wheel's megatron.training (megatron-core 0.17+)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "sitecustomize.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(_SITECUSTOMIZE.format(tests=_HERE,
                                       checkout=os.path.abspath(checkout) if checkout else None))
    return path
