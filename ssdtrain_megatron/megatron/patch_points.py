"""Does the imported megatron-core have what ``install()`` patches, where and as expected?

:mod:`.compat` says where each patch point lives in each release; :func:`verify` checks, before
anything is patched, that the megatron-core this process imports has every one of them there,
with the parameters the hooks rely on, and refuses in one line naming each that is missing or
changed. It is what makes a release newer than any tested safe to try at the user's word
(``OffloadConfig.allow_untested_megatron``): the newest release's patch points must all be
found first.
"""

from __future__ import annotations

import inspect
from typing import Callable, List, Optional, Tuple

from . import compat

__all__ = ["verify"]


def _params(fn: Callable) -> Tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


# What the hooks need of the patch points every release shares: the schedule functions the
# hooks wrap or tell apart, the parameters PipelineHooks.forward_step reads by name, and the
# calling conventions of the checkpoint functions the scopes wrap.
_SCHEDULES = ("forward_step", "get_forward_backward_func", "forward_backward_no_pipelining",
              "forward_backward_pipelining_without_interleaving",
              "forward_backward_pipelining_with_interleaving")
_FORWARD_STEP_READS = ("model", "input_tensor", "current_microbatch", "vp_stage")
_CHECKPOINT_PARAMS = ("function", "distribute_saved_activations", "args")
_WITHOUT_OUTPUT_PARAMS = ("self", "run_function", "args")


def _recompute_problem(release: compat.Release) -> Optional[str]:
    where = f"{release.recompute_module}.{release.recompute_name}"
    try:
        owner, name, _ = compat.recompute_patch_point(release)
    except (ImportError, AttributeError):
        return f"{where} is missing"
    return None if callable(vars(owner).get(name)) else f"{where} is missing"


def _shared_problems() -> List[str]:
    """The patch points of every release, checked against the imported megatron-core."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_layer import TransformerLayer

    problems = [f"schedules.{n} is missing" for n in _SCHEDULES
                if not callable(vars(schedules).get(n))]
    if not callable(vars(TransformerLayer).get("forward")):
        problems.append("TransformerLayer.forward is missing")
    forward_step = vars(schedules).get("forward_step")
    if callable(forward_step):
        missing = [p for p in _FORWARD_STEP_READS if p not in _params(forward_step)]
        if missing:
            problems.append(f"schedules.forward_step{_params(forward_step)} (expected "
                            f"parameters {', '.join(missing)})")
    checkpoint = vars(tp_random).get("checkpoint")
    if not callable(checkpoint):
        problems.append("tensor_parallel.random.checkpoint is missing")
    elif _params(checkpoint) != _CHECKPOINT_PARAMS:
        problems.append(f"tensor_parallel.random.checkpoint{_params(checkpoint)} (expected "
                        f"{_CHECKPOINT_PARAMS})")
    without_output = getattr(tp_random, "CheckpointWithoutOutput", None)
    method = vars(without_output).get("checkpoint") if without_output is not None else None
    if without_output is not None and (not callable(method)
                                       or _params(method) != _WITHOUT_OUTPUT_PARAMS):
        has = _params(method) if callable(method) else "missing"
        problems.append(f"CheckpointWithoutOutput.checkpoint {has} (expected "
                        f"{_WITHOUT_OUTPUT_PARAMS})")
    return problems


def verify(release: compat.Release, version: str) -> None:
    """Check that the imported megatron-core has every patch point ``install()`` replaces,
    where ``release`` says it lives and with the parameters the hooks rely on.

    Raises:
        UnsupportedMegatronVersion: one is missing or has other parameters; the message names
            it, what it has and what was expected.
    """
    from megatron.core.pipeline_parallel import schedules

    problems: List[str] = _shared_problems()
    recompute = _recompute_problem(release)
    if recompute:
        problems.append(recompute)
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
        raise compat.UnsupportedMegatronVersion(
            f"megatron-core {version} does not have the patch points of megatron-core "
            f"{release.minor}.x that ssdtrain_megatron.megatron was tested against: "
            f"{'; '.join(problems)}. {compat.install_hint(release)}, or run without "
            f"--ssd-offload.")
