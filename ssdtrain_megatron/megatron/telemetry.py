"""Where each step's StepStats go inside a Megatron training run, besides ``stats_path``.

- **TensorBoard**: when Megatron's training loop has a TensorBoard writer
  (``global_vars.get_tensorboard_writer()``; Megatron builds one with ``--tensorboard-dir``, on
  the last rank only), every numeric StepStats field becomes a scalar ``ssd_offload/<field>``
  at the iteration Megatron logs its own scalars at, every ``--tensorboard-log-interval``
  iterations; ``passed_through_by_reason`` becomes ``ssd_offload/passed_through/<reason>``
  and ``tier_bytes`` ``ssd_offload/tier_bytes/<place>``.
- **The log**: one INFO line with ``StepStats.summary()`` every ``--log-interval`` iterations,
  next to Megatron's own iteration line. Without Megatron's arguments (megatron-core in your own
  loop, the demo, the benchmarks) the offloader's DEBUG line after every step is the log.
- ``stats_path`` JSONL is written by the offloader itself (``end_step()``), for every step.

Megatron-LM keeps its globals in ``megatron.training.global_vars`` and Megatron-DeepSpeed in
``megatron.global_vars``. They are only looked up in ``sys.modules``, never imported: if the
training loop is running, its module is loaded; importing it otherwise would pull in all of
``megatron.training`` for nothing (or fail where only megatron-core is installed).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Dict, Optional, Tuple

from ..telemetry.stats import StepStats

log = logging.getLogger(__name__)

GLOBAL_VARS_MODULES = ("megatron.training.global_vars", "megatron.global_vars")
"""Where Megatron-LM and Megatron-DeepSpeed keep ``get_args`` / ``get_tensorboard_writer``."""

SCALAR_PREFIX = "ssd_offload/"

_NOT_SCALARS = ("step", "layers", "plan", "passed_through_by_reason", "not_offloaded_why", "tier_bytes",
                "tier_gbps", "bytes_wasted_by_origin")


def step_scalars(stats: StepStats) -> Dict[str, float]:
    """The StepStats fields written as TensorBoard scalars, by tag (``ssd_offload/<field>``)."""
    out = {SCALAR_PREFIX + f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)
           if f.name not in _NOT_SCALARS and isinstance(getattr(stats, f.name), (int, float))}
    for reason, n in sorted(stats.passed_through_by_reason.items()):  # only the reasons seen
        out[f"{SCALAR_PREFIX}passed_through/{reason}"] = n
    for place, n in sorted(stats.tier_bytes.items()):  # keep, and the engine's tiers
        out[f"{SCALAR_PREFIX}tier_bytes/{place}"] = n
    return out


def megatron_training_globals() -> Tuple[Any, Any]:
    """(TensorBoard writer or None, Megatron's parsed arguments or None) of the training loop
    running in this process, if any."""
    for name in GLOBAL_VARS_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        writer = getattr(module, "get_tensorboard_writer", lambda: None)()
        try:
            args = module.get_args()
        except AssertionError:  # Megatron's "args is not initialized."
            args = None
        return writer, args
    return None, None


def iteration_of(stats: StepStats, args: Any) -> int:
    """The iteration number Megatron logs this step under.

    Megatron sets ``args.curr_iteration`` to the number of finished iterations before it runs
    one (resumed runs included) and logs the step under that number plus one. Without it: the
    offloader's own count of steps, plus one.
    """
    current = getattr(args, "curr_iteration", None)
    if isinstance(current, int):
        return current + 1
    return stats.step + 1


def _every(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    return value if isinstance(value, int) and value > 0 else 1


def publish_step(stats: StepStats, writer: Any = None, args: Any = None,
                 lookup: bool = True) -> Optional[int]:
    """Send one step's StepStats to Megatron's TensorBoard writer and log.

    Args:
        stats: the step's statistics (``ActivationOffloader.end_step()``).
        writer: a TensorBoard ``SummaryWriter`` (anything with ``add_scalar(tag, value,
            step)``); with ``lookup``, Megatron's writer when this is None.
        args: Megatron's arguments (``log_interval``, ``tensorboard_log_interval``,
            ``curr_iteration``); with ``lookup``, Megatron's when this is None.
        lookup: find the writer and arguments of a Megatron training loop in this process.

    Returns:
        The iteration the scalars were written at, or None when nothing was written.
    """
    if lookup and (writer is None or args is None):
        found_writer, found_args = megatron_training_globals()
        writer = writer if writer is not None else found_writer
        args = args if args is not None else found_args
    iteration = iteration_of(stats, args)
    if args is not None and iteration % _every(args, "log_interval") == 0:
        log.info("ssdtrain iteration %d: %s", iteration, stats.summary())
    if writer is None or iteration % _every(args, "tensorboard_log_interval") != 0:
        return None
    for tag, value in step_scalars(stats).items():
        writer.add_scalar(tag, value, iteration)
    return iteration
