"""Run megatron-core 0.16-0.19 on a CPU-only torch build: for the demo, benchmarks and tests.

This is not part of the offload path: ``install()`` never calls it, and on a machine with CUDA
nothing here is needed. It exists so that ``ssdtrain demo`` and ``ssdtrain bench`` (and the test
suite) can build and train a real megatron-core GPTModel on a laptop or a CI machine.

megatron-core assumes CUDA in a handful of places that have nothing to do with the numerics:
buffers and factory calls with ``device=torch.cuda.current_device()``, ``.cuda()`` calls,
``torch.cuda.synchronize()``, and an RNG tracker that stores CUDA generator states. While
enabled, this module redirects all of them to the CPU:

* a :class:`torch.overrides.TorchFunctionMode` rewrites ``device="cuda"``, ``device=<int>`` and
  ``torch.device("cuda", i)`` arguments to ``"cpu"``, makes ``torch.device(<int>)`` the CPU and
  turns ``Tensor.cuda()`` into a no-op;
* ``torch.cuda.current_device`` returns 0 (an integer device the mode maps to the CPU),
  ``torch.cuda.synchronize`` does nothing, ``torch.cuda.manual_seed`` / ``get_rng_state`` /
  ``set_rng_state`` act on the default CPU generator;
* megatron's "CUDA" RNG state is the default CPU generator's state: dropout on CPU draws from that
  generator, so forking the tracker (tensor-parallel regions) and restoring states for
  recomputation (``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``) act on
  exactly the numbers the kernels use, and recomputed dropout masks equal the original ones;
* ``GlobalMemoryBuffer.get_tensor`` allocates on the CPU;
* mixture-of-experts layers get three stand-ins: ``torch.cuda.Stream`` / ``current_stream`` /
  ``stream`` are a :class:`CpuStreamStandIn` (the ``alltoall`` token dispatcher and the shared
  experts create a side stream in their constructor; on the CPU every op runs in program order,
  so waiting on or recording one has nothing to do), and megatron-core 0.16's ``moe_utils``,
  which names ``te_general_gemm`` only when Transformer Engine imports, gets it as None, so the
  router's gating GEMM takes its own torch.mm path (what a build with the name defined but TE
  absent does); the alltoall dispatcher's "move the split sizes to the host as numpy" step,
  which skips tensors already on the CPU, converts them here too;
* multi-latent attention: megatron-core 0.16's ``multi_latent_attention`` module sets its own
  ``HAVE_TE`` when importing ``extensions.transformer_engine`` succeeds, which it does without
  Transformer Engine too (its TE classes are then mocks), and ``MultiLatentAttention`` then
  asks ``isinstance(linear_proj, TELinear)`` of a mock, a TypeError: where TE is absent the
  flag is set to False, what it says. (The local spec's core attention for MLA is a separate
  matter: tests/mla_attention_stand_in.py.)
* selective recompute of ``layernorm`` / ``moe_act``: ``CheckpointWithoutOutput()``'s default
  counts as FP8 (``fp8 is not None``, megatron-core 0.16-0.17), so it asks Transformer Engine's
  ``FP8GlobalStateManager``, ``activation_recompute_forward`` and ``fp8_autocast``, names
  ``tensor_parallel.random`` defines only when TE imports: without TE they are stand-ins that
  say FP8 is off and enter nothing, what TE says and does when FP8 is not enabled.

``enable()`` is idempotent; ``disable()`` puts back every attribute it replaced, the same objects
as before. It refuses to enable where CUDA is available: there, megatron runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable", "disable", "is_enabled", "enabled", "CpuDeviceMode", "CpuStreamStandIn"]


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (str, int, torch.device) to "cpu"; leave anything else alone."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str):
        if device.startswith("cuda"):
            return torch.device("cpu")
        return device
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            # Tensor.cuda(device=None, non_blocking=False, ...) -> the tensor itself.
            return args[0]
        if func is torch.device and args and isinstance(args[0], int) \
                and not isinstance(args[0], bool):
            # torch.device(<int>) names an accelerator, an error without one (yarn rotary
            # embedding: ``with torch.device(torch.cuda.current_device())``).
            return torch.device("cpu")
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func in (torch.Tensor.to,) and len(args) > 1:
            # Tensor.to(device, ...) or Tensor.to(tensor) or Tensor.to(dtype).
            first = args[1]
            if isinstance(first, (str, int, torch.device)) and not isinstance(first, bool):
                args = (args[0], _to_cpu_device(first)) + tuple(args[2:])
        return func(*args, **kwargs)


def _backward_under_cpu_mode(original: Callable) -> Callable:
    """Wrap ``BackwardCFunction.apply`` so a custom autograd function's backward runs under a
    CpuDeviceMode. torch runs a mode's handler with that mode switched off, and the whole
    backward pass runs inside the handler of ``torch.autograd.backward``: without this, a
    backward that allocates on "the current CUDA device" (megatron's gather / reduce-scatter
    along the first dimension, which the MoE allgather dispatcher runs) would ask for CUDA."""

    @functools.wraps(original)
    def apply(self, *args):
        with CpuDeviceMode():
            return original(self, *args)

    return apply


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add backed by the default CPU generator."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception("seed {} already exists".format(seed))
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception("cuda rng state {} already exists".format(name))
    orig = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


def _make_tracker_fork(default_name: str) -> Callable:
    @contextlib.contextmanager
    def fork(self, name: str = default_name):
        """CudaRNGStatesTracker.fork backed by the default CPU generator.

        megatron's own fork warns when the CPU generator moved inside the context; here the
        "CUDA" generator *is* the CPU generator, so that warning would fire on every dropout.
        """
        if name not in self.states_:
            raise Exception("cuda rng state {} is not added".format(name))
        orig_state = torch.get_rng_state()
        orig_name = getattr(self, "_current_state_name", "default-rng")
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name

    return fork


def _buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """GlobalMemoryBuffer.get_tensor allocating on the CPU."""
    required_len = functools.reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype), None)
    if buf is None or buf.numel() < required_len:
        buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buf
    return buf[0:required_len].view(*tensor_shape)


class _CpuEventStandIn:
    """What ``CpuStreamStandIn.record_event()`` returns: already complete."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        return None


class CpuStreamStandIn:
    """Stand-in for ``torch.cuda.Stream`` on a CPU-only torch (not a stream: CPU ops run in
    program order, so there is nothing to wait for or record). One instance is "the current
    stream"; every other one compares unequal to it, as a side stream does."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEventStandIn:
        return _CpuEventStandIn()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CURRENT_STREAM = CpuStreamStandIn()


@contextlib.contextmanager
def _stream_context(stream: Any = None):
    """``torch.cuda.stream(s)`` stand-in: CPU ops run where they are issued."""
    yield


def _patch_moe_stand_ins(state: "_State") -> None:
    """The CUDA-/TE-only names megatron-core's MoE layers touch (see the module docstring)."""
    state.patch(torch.cuda, "Stream", CpuStreamStandIn)
    state.patch(torch.cuda, "current_stream", lambda device=None: _CURRENT_STREAM)
    state.patch(torch.cuda, "stream", _stream_context)
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # a megatron-core without MoE: nothing to stand in for
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        state.patch(moe_utils, "te_general_gemm", None)
    from megatron.core.transformer.moe import token_dispatcher

    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        state.patch(token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_on_cpu)
    # The alltoall dispatcher keeps its side stream on the class, made by the first instance:
    # disable() puts the class's own value back, so no stand-in outlives the runtime.
    dispatcher_cls = getattr(token_dispatcher, "MoEAlltoAllTokenDispatcher", None)
    if dispatcher_cls is not None and "cuda_dtoh_stream" in vars(dispatcher_cls):
        state.patch(dispatcher_cls, "cuda_dtoh_stream", dispatcher_cls.cuda_dtoh_stream)


def _patch_mla_without_te(state: "_State") -> None:
    """MLA's own HAVE_TE flag, False where megatron-core's TE extension found no TE."""
    try:
        from megatron.core.extensions import transformer_engine as te_extension
        from megatron.core.transformer import multi_latent_attention
    except ImportError:  # a megatron-core without MLA: nothing to stand in for
        return
    if not te_extension.HAVE_TE and getattr(multi_latent_attention, "HAVE_TE", False):
        state.patch(multi_latent_attention, "HAVE_TE", False)


class _Fp8StateStandIn:
    """Stand-in for TE's ``FP8GlobalStateManager``: FP8 is never enabled on the CPU."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


def _no_context(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    """Stand-in for TE's ``activation_recompute_forward`` / ``fp8_autocast`` without FP8."""
    return contextlib.nullcontext()


def _patch_fp8_checkpoint_stand_ins(state: "_State") -> None:
    """The TE names CheckpointWithoutOutput asks for (see the module docstring)."""
    from megatron.core.tensor_parallel import random as mcore_random

    stand_ins = {"FP8GlobalStateManager": _Fp8StateStandIn,
                 "activation_recompute_forward": _no_context, "fp8_autocast": _no_context}
    for name, stand_in in stand_ins.items():
        if not hasattr(mcore_random, name):
            state.patch(mcore_random, name, stand_in)


def _split_sizes_on_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Stand-in for moe_utils.maybe_move_tensor_to_cpu, which converts only CUDA tensors: the
    alltoall dispatcher's split sizes are already on the CPU here, and still have to become the
    numpy arrays ``all_to_all_single`` takes as split sizes, as they do on a GPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


class _State:
    """What enable() replaced: (owner, attribute name, original value), in patch order."""

    def __init__(self) -> None:
        self.saved: List[Tuple[Any, str, Any]] = []
        self.mode: Optional[CpuDeviceMode] = None

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, owner.__dict__.get(name, _MISSING)
                           if isinstance(owner, type) else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)


_MISSING = object()
_STATE: Optional[_State] = None


def is_enabled() -> bool:
    return _STATE is not None


def enable() -> None:
    """Install the CPU shims (idempotent). Import megatron.core only after torch is importable."""
    global _STATE
    if _STATE is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("ssdtrain_megatron.tools.megatron_cpu is for CPU-only machines; with CUDA, "
                           "megatron-core runs as it is")
    from megatron.core import utils as mcore_utils
    from megatron.core.tensor_parallel import random as mcore_random

    state = _State()
    state.patch(torch.cuda, "current_device", lambda: 0)
    state.patch(torch.cuda, "synchronize", lambda device=None: None)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (a lazy no-op without CUDA), so
    # seed the CPU generator directly rather than through torch.manual_seed.
    state.patch(torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed))
    state.patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    state.patch(torch.cuda, "set_rng_state",
                lambda new_state, device="cuda": torch.set_rng_state(new_state))
    state.patch(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    state.patch(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    tracker_cls = mcore_random.CudaRNGStatesTracker
    state.patch(tracker_cls, "add", _tracker_add)
    state.patch(tracker_cls, "fork",
                _make_tracker_fork(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME))
    state.patch(mcore_utils.GlobalMemoryBuffer, "get_tensor", _buffer_get_tensor)
    _patch_moe_stand_ins(state)
    _patch_mla_without_te(state)
    _patch_fp8_checkpoint_stand_ins(state)
    backward_cls = torch.autograd.function.BackwardCFunction
    state.patch(backward_cls, "apply", _backward_under_cpu_mode(backward_cls.apply))
    state.mode = CpuDeviceMode()
    state.mode.__enter__()
    _STATE = state


def disable() -> None:
    """Undo enable(): every replaced attribute gets its original object back."""
    global _STATE
    state = _STATE
    if state is None:
        return
    _STATE = None
    if state.mode is not None:
        state.mode.__exit__(None, None, None)
    for owner, name, original in reversed(state.saved):
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


@contextlib.contextmanager
def enabled():
    """Context manager form: enable() on entry, disable() on exit (if it enabled)."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
