"""The door of a job started by the launcher: its arguments parsed once into a
:class:`~ssdtrain_megatron.plan.job.Job`, which plan/job.py's :func:`job_settings` (the one
sequence) turns into the settings the job runs.

Two ways in, one result: at install, Megatron's parsed arguments (:func:`settings_from_args`:
every Megatron value there is what runs, its defaults included); before Megatron starts, the
command line (:func:`settings_from_argv`, the pre-flight and ``ssdtrain plan -- ARGS``), read
by :func:`megatron_namespace` into the same attribute names. A command line with
``--num-layers`` is a whole Megatron command line, and Megatron's defaults fill what it does not
give (tp, pp, cp 1; no sequence parallelism or recompute; global batch micro-batch x dp); one
without (the flag group alone, as ``ssdtrain doctor --preflight --config`` checks) keeps the
preset's layout where no flag is given.

The model is the preset's with Megatron's values over it, or without a preset model the one
Megatron's arguments describe (:func:`megatron_model`); its data-parallel size is the world size
over tp x pp x cp; micro-batches per iteration the global batch over micro-batch x dp. The node
is ``--ssd-offload-node``, else the preset's ``node:`` section, else
:data:`~ssdtrain_megatron.plan.node.DEFAULT_NODE`; host memory per rank is what is free here
(host_memory.py) over the local ranks. Nothing here imports megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, Optional, Sequence

from ..config import OffloadConfig
from ..plan.engine_choice import USABLE_FRACTION
from ..plan.job import Job, JobError, Settings, as_megatron_runs, job_settings
from ..plan.node import DEFAULT_NODE, NodeProfile, load_profile
from ..plan.preset_file import PresetFile, preset_of
from ..plan.shape import ModelShape
from .args import explicit_fields, flag_for
from .host_memory import HostMemory
from .megatron_flags import add_time_flags, flash_attention, padded_vocab, time_fields, virtual_pipeline

SHAPE_ARGS = {"num_layers": "num_layers", "hidden_size": "hidden", "num_attention_heads": "heads",
              "ffn_hidden_size": "ffn_hidden", "seq_length": "seq_len",
              "micro_batch_size": "micro_batch", "tensor_model_parallel_size": "tp",
              "pipeline_model_parallel_size": "pp", "context_parallel_size": "cp",
              "expert_model_parallel_size": "ep", "sequence_parallel": "sequence_parallel",
              "recompute_granularity": "recompute",
              "use_distributed_optimizer": "distributed_optimizer"}
"""Megatron's argument (its namespace's name) -> the ModelShape field it sets."""

LAYOUT_DEFAULTS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                   "context_parallel_size": 1, "expert_model_parallel_size": 1,
                   "sequence_parallel": False, "recompute_granularity": None,
                   "use_distributed_optimizer": False}
"""Megatron's defaults for the layout: what runs when a whole command line does not say."""

FLAG_OF = {name: "--" + name.replace("_", "-") for name in SHAPE_ARGS}
FLAG_OF.update(global_batch_size="--global-batch-size")


class _MegatronFlags(argparse.ArgumentParser):
    """Megatron's flags that shape the job; a bad value is a JobError, not an exit."""

    def error(self, message: str):  # noqa: D401 - argparse's hook: raise instead of exiting
        raise JobError(message)


def _megatron_parser() -> argparse.ArgumentParser:
    parser = _MegatronFlags(add_help=False, allow_abbrev=False)
    for name in SHAPE_ARGS:
        if name in ("sequence_parallel", "use_distributed_optimizer"):
            parser.add_argument(FLAG_OF[name], dest=name, action="store_true", default=None)
        elif name == "recompute_granularity":
            parser.add_argument(FLAG_OF[name], dest=name, default=None)
        else:
            parser.add_argument(FLAG_OF[name], dest=name, type=int, default=None)
    parser.add_argument("--global-batch-size", dest="global_batch_size", type=int, default=None)
    parser.add_argument("--num-query-groups", dest="num_query_groups", type=int, default=None)
    parser.add_argument("--group-query-attention", dest="group_query_attention",
                        action="store_true", default=False)
    parser.add_argument("--kv-channels", dest="kv_channels", type=int, default=None)
    parser.add_argument("--swiglu", action="store_true", default=False)
    parser.add_argument("--bf16", action="store_true", default=False)
    parser.add_argument("--fp16", action="store_true", default=False)
    parser.add_argument("--num-experts", dest="num_experts", type=int, default=None)
    parser.add_argument("--moe-router-topk", dest="moe_router_topk", type=int, default=None)
    parser.add_argument("--moe-ffn-hidden-size", dest="moe_ffn_hidden_size", type=int, default=None)
    add_optimizer_flags(parser)
    add_time_flags(parser)
    return parser


def add_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron's flags that set the model state's precision and its optimizer CPU offload,
    under Megatron's names and defaults (``--optimizer-offload-fraction``: 1.0)."""
    for flag in ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
                 "--use-precision-aware-optimizer", "--accumulate-allreduce-grads-in-fp32"):
        parser.add_argument(flag, dest=flag[2:].replace("-", "_"), action="store_true",
                            default=False)
    parser.add_argument("--optimizer-offload-fraction", dest="optimizer_offload_fraction",
                        type=float, default=1.0)
    parser.add_argument("--main-grads-dtype", dest="main_grads_dtype", default="fp32")


def _is_16bit(value: Any) -> bool:
    """A dtype named as Megatron's flag does ('bf16', 'fp16') or as its parsed torch dtype."""
    return str(value).rsplit(".", 1)[-1] in ("bf16", "fp16", "bfloat16", "float16")


def optimizer_fields(args: argparse.Namespace) -> Dict[str, Any]:
    """The ModelShape fields of the model state's precision and of megatron-core's optimizer
    CPU offload, from Megatron's arguments (its namespace at install, or
    :func:`megatron_namespace`'s): ``main_grad_bytes`` (4: fp32, what Megatron runs with bf16,
    and with fp16 under ``--accumulate-allreduce-grads-in-fp32``; 2: ``--main-grads-dtype
    bf16``, or fp16 without that flag), ``optimizer_offload_fraction`` (0 without
    ``--optimizer-cpu-offload``) and ``overlap_optimizer_d2h_h2d``. Nothing where the arguments
    say nothing of them (the flag group alone keeps the preset's).

    Raises:
        JobError: ``--optimizer-cpu-offload`` without ``--use-precision-aware-optimizer`` and
            ``--use-distributed-optimizer`` (Megatron refuses it), or a fraction outside [0, 1].
    """
    offload = bool(getattr(args, "optimizer_cpu_offload", False))
    whole = getattr(args, "whole", "num_layers" in vars(args))
    if not offload and not whole:
        return {}
    found: Dict[str, Any] = {}
    if whole:
        fp16 = bool(getattr(args, "fp16", False))
        grads16 = _is_16bit(getattr(args, "main_grads_dtype", "fp32")) or (
            fp16 and not getattr(args, "accumulate_allreduce_grads_in_fp32", False))
        found["main_grad_bytes"] = 2 if grads16 else 4
    if not offload:
        found["optimizer_offload_fraction"] = 0.0
        return found
    missing = [flag for flag, name in (("--use-precision-aware-optimizer",
                                        "use_precision_aware_optimizer"),
                                       ("--use-distributed-optimizer", "use_distributed_optimizer"))
               if not getattr(args, name, False)]
    if missing:
        raise JobError("--optimizer-cpu-offload needs " + " and ".join(missing) + " (megatron-core "
                       "steps the offloaded part with its precision-aware distributed optimizer): "
                       "add " + " ".join(missing))
    fraction = getattr(args, "optimizer_offload_fraction", 1.0)
    if not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise JobError(f"--optimizer-offload-fraction {fraction} is invalid: expected a fraction "
                       "from 0 to 1")
    found.update(optimizer_offload_fraction=float(fraction),
                 overlap_optimizer_d2h_h2d=bool(getattr(args, "overlap_cpu_optimizer_d2h_h2d",
                                                        False)))
    return found


def megatron_namespace(argv: Sequence[str], world_size: Optional[int]) -> argparse.Namespace:
    """Megatron's arguments in ``argv`` under Megatron's own names (the rest ignored), with
    ``world_size``; Megatron's layout defaults where ``--num-layers`` makes it a whole command
    line (see the module docstring).

    Raises:
        JobError: a Megatron flag's value is not what Megatron takes (one line naming it).
    """
    ns, _ = _megatron_parser().parse_known_args(list(argv))
    if ns.num_layers is not None:
        for name, value in LAYOUT_DEFAULTS.items():
            if getattr(ns, name) is None:
                setattr(ns, name, value)
    ns.world_size = world_size
    ns.whole = ns.num_layers is not None
    return ns


def megatron_fields(args: argparse.Namespace) -> Dict[str, Any]:
    """The ModelShape fields Megatron's arguments set (those it has; None is not given)."""
    found: Dict[str, Any] = {}
    whole = getattr(args, "whole", "num_layers" in vars(args))
    found.update(time_fields(args, bool(whole)))
    pp = getattr(args, "pipeline_model_parallel_size", None)
    vp = virtual_pipeline(args, getattr(args, "num_layers", None), pp or 1)
    if vp > 1 or whole:
        found["vp"] = vp
    for name, field in SHAPE_ARGS.items():
        value = getattr(args, name, None)
        if name == "recompute_granularity":
            if value is not None or getattr(args, "whole", "num_layers" in vars(args)):
                found[field] = value or "none"
        elif isinstance(value, bool) and field in ("sequence_parallel", "distributed_optimizer"):
            found[field] = value
        elif isinstance(value, int) and not isinstance(value, bool):
            found[field] = value
    found.update(optimizer_fields(args))
    if getattr(args, "recompute_activations", False) and not getattr(args, "recompute_granularity", None):
        found["recompute"] = "selective"  # Megatron's --recompute-activations
    return found


def megatron_model(args: argparse.Namespace) -> Optional[ModelShape]:
    """The model Megatron's arguments describe, for a job without a preset model; None where
    they lack its shape (the flag group alone) or the planner does not take it."""
    need = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")
    if not all(isinstance(getattr(args, n, None), int) for n in need):
        return None
    heads, hidden = args.num_attention_heads, args.hidden_size
    kv_channels = getattr(args, "kv_channels", None)
    experts = getattr(args, "num_experts", None)
    fields = megatron_fields(args)
    fields.update(
        ffn_hidden=getattr(args, "ffn_hidden_size", None) or 4 * hidden,
        kv_groups=getattr(args, "num_query_groups", None)
        if getattr(args, "group_query_attention", False) else None,
        kv_channels=kv_channels if kv_channels and kv_channels * heads != hidden else None,
        dtype_bytes=2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else 4,
        # Transformer Engine's attention (Megatron-LM's default) is fused: no s x s saved
        flash_attention=flash_attention(args),
        swiglu=bool(getattr(args, "swiglu", False)),
        vocab=_vocab(args),
        attention_dropout=getattr(args, "attention_dropout", 0.1),
        hidden_dropout=getattr(args, "hidden_dropout", 0.1),
        num_experts=experts, moe_topk=getattr(args, "moe_router_topk", 2) or 2,
        moe_ffn_hidden=getattr(args, "moe_ffn_hidden_size", None) if experts else None)
    try:
        return ModelShape(**fields)
    except (TypeError, ValueError):
        return None


def _vocab(args: argparse.Namespace) -> Optional[int]:
    """Megatron's padded vocabulary: its own at install, else --vocab-size padded as it pads."""
    padded = getattr(args, "padded_vocab_size", None)
    if padded:
        return padded
    vocab = getattr(args, "vocab_size", None)
    if not vocab:
        return None
    return padded_vocab(vocab, getattr(args, "make_vocab_size_divisible_by", 128) or 128,
                        getattr(args, "tensor_model_parallel_size", 1) or 1)


def job_shape(preset: Optional[PresetFile], megatron: argparse.Namespace) -> Optional[ModelShape]:
    """The model per GPU as the job runs it: the preset's (or Megatron's) with Megatron's
    values over it and dp from the world size; None without a model.

    Raises:
        JobError: the world size does not divide by tp x pp x cp, or the global batch by
            micro-batch x dp (one line naming the flag and what would fit).
    """
    base = preset.shape() if preset is not None else None
    if base is None:
        shape = megatron_model(megatron)
    else:
        try:
            shape = base.replace(**as_megatron_runs(base, megatron_fields(megatron)))
        except JobError:
            raise  # a flag's own one line (optimizer_fields)
        except (TypeError, ValueError) as exc:
            raise JobError(f"Megatron's flags do not fit {preset.path}'s model: {exc}") from None
    if shape is None:
        return None
    world = getattr(megatron, "world_size", None)
    if isinstance(world, int) and world > 0:
        if world % shape.model_parallel:
            raise JobError(
                f"the world size {world} is not a multiple of --tensor-model-parallel-size "
                f"{shape.tp} x --pipeline-model-parallel-size {shape.pp} x "
                f"--context-parallel-size {shape.cp} = {shape.model_parallel}: "
                f"{(world // shape.model_parallel or 1) * shape.model_parallel} GPUs would fit")
        shape = shape.replace(dp=world // shape.model_parallel)
    elif isinstance(getattr(megatron, "data_parallel_size", None), int):
        shape = shape.replace(dp=megatron.data_parallel_size)
    return shape


def micro_batches(shape: ModelShape, megatron: argparse.Namespace) -> Optional[int]:
    """Micro-batches per iteration as Megatron computes them; None where nothing says.

    Raises:
        JobError: --global-batch-size is not a multiple of micro-batch x dp."""
    gbs = getattr(megatron, "global_batch_size", None)
    per_step = shape.micro_batch * shape.dp
    if gbs is None:
        return 1 if getattr(megatron, "whole", False) else None  # Megatron: gbs = b x dp
    if gbs % per_step:
        raise JobError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size "
                       f"{shape.micro_batch} x data-parallel size {shape.dp} = {per_step}: "
                       f"{max(gbs // per_step, 1) * per_step} would fit")
    return gbs // per_step


def host_per_rank(host: Optional[HostMemory]) -> Optional[int]:
    """Host memory one rank may fill (pool and staging): the usable share of what is free."""
    if host is None:
        return None
    return int(host.free_bytes * USABLE_FRACTION) // max(host.local_ranks, 1)


def job_from_args(args: argparse.Namespace, megatron: argparse.Namespace,
                  host: Optional[HostMemory], recompute: bool = True,
                  node: Optional[NodeProfile] = None) -> Job:
    """The Job of a launcher's parsed flag group ``args`` and Megatron's arguments
    ``megatron`` (the same namespace at install). ``node``: replaces the flag's and preset's.

    Raises:
        ConfigError: the flags and the preset are invalid together.
        JobError, ValueError: the preset's model or node, or the layout (one line).
    """
    path = getattr(args, "ssd_offload_config", None)
    preset = preset_of(path) if path else None
    base = preset.config() if preset is not None else OffloadConfig()
    explicit = explicit_fields(args)
    config = base.replace(**explicit) if explicit else base
    given = {name: "the preset" for name in (preset.fields() if preset else ())}
    given.update({name: flag_for(name) for name in explicit})
    if node is None:
        named = getattr(args, "ssd_offload_node", None)
        node = load_profile(named) if named else (
            (preset.node_profile() if preset else None) or load_profile(DEFAULT_NODE))
    shape = job_shape(preset, megatron)
    return Job(config, given, shape, node, host_per_rank(host),
               host.describe() if host is not None else "host memory not measured",
               micro_batches(shape, megatron) if shape is not None else None, recompute)


def settings_from_args(args: argparse.Namespace, host: Optional[HostMemory],
                       recompute: bool = True) -> Settings:
    """At install: the settings of Megatron's parsed arguments (the flag group among them). On
    a device without CUDA nothing pins staging (plan/job.py ``Job.staging_pinned``)."""
    job = job_from_args(args, args, host, recompute)
    return job_settings(dataclasses.replace(job, staging_pinned=cuda_here()))


def cuda_here() -> bool:
    """Whether this process trains on CUDA (the offloader's device: cache/offloader.py)."""
    import torch

    return torch.cuda.is_available()


def settings_from_argv(args: argparse.Namespace, argv: Sequence[str], host: Optional[HostMemory],
                       world_size: Optional[int], recompute: bool = True,
                       node: Optional[NodeProfile] = None) -> Settings:
    """Before Megatron starts: the settings of a launcher command line (``args``: its flag
    group, parsed)."""
    return job_settings(job_from_args(args, megatron_namespace(argv, world_size), host,
                                      recompute, node))


__all__ = ["FLAG_OF", "SHAPE_ARGS", "add_optimizer_flags", "host_per_rank", "job_from_args",
           "job_shape", "megatron_fields", "megatron_model", "megatron_namespace",
           "micro_batches", "optimizer_fields", "settings_from_args", "settings_from_argv"]
