"""The offload settings a job runs: the flags over the preset, and where neither names the
engine, the engine the node calls for (plan/engine_choice.py: tiered where host memory is to
spare, posix where it is not), with the one line that says which and why.

Used where a job starts: the launcher's hooks right before ``install()`` (launch.py, on the
parsed Megatron arguments) and its pre-flight (preflight.py, on the command line, so that the
free-space check counts what host memory will take). The model planned is the preset's, with
Megatron's own shape flags over it, or without a preset model the one Megatron's parsed
arguments describe (:func:`megatron_model`); the node is the preset's ``node:`` section (else
:data:`~ssdtrain_megatron.plan.node.DEFAULT_NODE`) with its host memory replaced by what is
free here (host_memory.py). Nothing here imports megatron.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ..config import OffloadConfig
from ..plan.engine_choice import (EngineChoice, choose_engine, forced, free_per_rank, host_need,
                                  tiered_settings)
from ..plan.node import DEFAULT_NODE, NodeProfile, load_profile, profile_from_preset
from ..plan.shape import ModelShape
from .args import config_from_args, given_fields
from .host_memory import HostMemory

MEGATRON_SHAPE_FLAGS = {"--num-layers": "num_layers", "--seq-length": "seq_len",
                        "--micro-batch-size": "micro_batch",
                        "--tensor-model-parallel-size": "tp",
                        "--pipeline-model-parallel-size": "pp"}
"""Megatron flags that change what one GPU keeps, and the ModelShape field each sets."""


def _preset_data(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    import yaml

    with open(path, encoding="utf-8") as fh:  # read (and validated) by the flag's parser
        data = yaml.safe_load(fh)
    return data if isinstance(data, dict) and "model" in data else None


def preset_shape(path: Optional[str], megatron: Mapping[str, int]) -> Optional[ModelShape]:
    """The preset's model with ``megatron``'s shape (ModelShape fields from Megatron's flags)
    over it; None without a ``model:`` section, or where Megatron's flags do not fit it
    (Megatron then says so, in its terms).

    Raises:
        ValueError: the preset's own model or parallel section is invalid.
    """
    data = _preset_data(path)
    if data is None:
        return None
    shape = ModelShape.from_preset(data["model"], data.get("parallel"))
    try:
        return shape.replace(**megatron)
    except (TypeError, ValueError):
        return None


def preset_node(path: Optional[str]) -> NodeProfile:
    """The preset's ``node:`` section, else the default node."""
    data = _preset_data(path)
    if data is not None and data.get("node") is not None:
        return profile_from_preset(data["node"], source=f"{path}: node")
    return load_profile(DEFAULT_NODE)


def megatron_shape_from_argv(argv: Sequence[str]) -> Dict[str, int]:
    """The ModelShape fields Megatron's flags in ``argv`` set (the last of each wins)."""
    found: Dict[str, int] = {}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in MEGATRON_SHAPE_FLAGS:
            continue
        value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        try:
            found[MEGATRON_SHAPE_FLAGS[flag]] = int(value)
        except ValueError:
            continue
    return found


def megatron_shape_from_args(args: argparse.Namespace) -> Dict[str, int]:
    """The ModelShape fields Megatron's parsed arguments set."""
    found: Dict[str, int] = {}
    for flag, name in MEGATRON_SHAPE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if isinstance(value, int) and not isinstance(value, bool):
            found[name] = value
    return found


def megatron_model(args: argparse.Namespace) -> Optional[ModelShape]:
    """The model Megatron's parsed arguments describe, for a job without a preset; None where
    they lack its shape (the flag group alone) or the planner does not take it."""
    need = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")
    if not all(isinstance(getattr(args, n, None), int) for n in need):
        return None
    heads, hidden = args.num_attention_heads, args.hidden_size
    kv_channels = getattr(args, "kv_channels", None)
    experts = getattr(args, "num_experts", None)
    try:
        return ModelShape(
            num_layers=args.num_layers, hidden=hidden, heads=heads,
            ffn_hidden=getattr(args, "ffn_hidden_size", None) or 4 * hidden,
            seq_len=args.seq_length, micro_batch=args.micro_batch_size,
            kv_groups=getattr(args, "num_query_groups", None)
            if getattr(args, "group_query_attention", False) else None,
            kv_channels=kv_channels if kv_channels and kv_channels * heads != hidden else None,
            dtype_bytes=2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else 4,
            tp=getattr(args, "tensor_model_parallel_size", 1) or 1,
            pp=getattr(args, "pipeline_model_parallel_size", 1) or 1,
            cp=getattr(args, "context_parallel_size", 1) or 1,
            ep=getattr(args, "expert_model_parallel_size", 1) or 1,
            dp=getattr(args, "data_parallel_size", 1) or 1,
            sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
            # Transformer Engine's attention (Megatron-LM's default) is fused: no s x s saved
            flash_attention=getattr(args, "transformer_impl", None) == "transformer_engine"
            or bool(getattr(args, "use_flash_attn", False)),
            swiglu=bool(getattr(args, "swiglu", False)),
            recompute=getattr(args, "recompute_granularity", None) or "none",
            vocab=getattr(args, "padded_vocab_size", None),
            attention_dropout=getattr(args, "attention_dropout", 0.1),
            hidden_dropout=getattr(args, "hidden_dropout", 0.1),
            num_experts=experts, moe_topk=getattr(args, "moe_router_topk", 2) or 2,
            moe_ffn_hidden=getattr(args, "moe_ffn_hidden_size", None) if experts else None,
            distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))
    except (TypeError, ValueError):
        return None


def micro_batches_from_args(args: argparse.Namespace) -> Optional[int]:
    """Micro-batches per iteration as Megatron computes them (global batch over micro-batch
    times data-parallel size), or None where its arguments do not say."""
    gbs, b = getattr(args, "global_batch_size", None), getattr(args, "micro_batch_size", None)
    dp = getattr(args, "data_parallel_size", None)
    if all(isinstance(v, int) and v > 0 for v in (gbs, b, dp)) and gbs % (b * dp) == 0:
        return gbs // (b * dp)
    return None


def follow_node(config: OffloadConfig, given: Mapping[str, str], shape: Optional[ModelShape],
                node: NodeProfile, host: Optional[HostMemory],
                num_micro_batches: Optional[int] = None,
                recompute: bool = True) -> Tuple[OffloadConfig, EngineChoice]:
    """``config`` with the engine the node calls for where ``given`` (field -> who set it) has
    none, and the choice with its line. ``num_micro_batches`` None: the pipeline's depth (the
    most micro-batches the first stage holds at once). ``recompute``: whether the integration
    can recompute a layer (Megatron-DeepSpeed cannot: the fallback then stays off)."""
    if "engine" in given:
        return config, forced(config.engine, f"{given['engine']} ({config.engine})")
    if host is None:
        return config, EngineChoice("posix", "engine posix: host memory cannot be measured here "
                                             "(no /proc/meminfo); --ssd-offload-engine tiered uses it")
    per_rank = free_per_rank(host.free_bytes, host.local_ranks, config.staging_bytes())
    need = None
    if shape is not None:
        runs = tiered_settings(given, config, recompute)
        need = host_need(shape, config, node, num_micro_batches or shape.pp, per_rank,
                         runs["policy"], runs["recompute_fallback"])
    choice = choose_engine(given, config, per_rank, host.describe(), need, recompute)
    return config.replace(**choice.changes), choice


def job_settings(args: argparse.Namespace, host: Optional[HostMemory],
                 megatron: Optional[Mapping[str, Any]] = None,
                 recompute: bool = True) -> Tuple[OffloadConfig, EngineChoice]:
    """The OffloadConfig a job runs from its parsed flags (``args``: Megatron's whole namespace
    at install, or the flag group alone), and the choice of its engine. ``megatron``: the
    ModelShape fields Megatron's flags set (default: read from ``args``); ``recompute``: as
    :func:`follow_node`.

    Raises:
        ConfigError: the flags and the preset are invalid together.
        ValueError: the preset's model, parallel or node section is invalid.
    """
    config = config_from_args(args)
    preset = getattr(args, "ssd_offload_config", None)
    shape = preset_shape(preset, megatron_shape_from_args(args) if megatron is None else megatron)
    if shape is None and _preset_data(preset) is None:
        shape = megatron_model(args)  # no preset model: the one Megatron's flags describe
    return follow_node(config, given_fields(args), shape, preset_node(preset), host,
                       micro_batches_from_args(args), recompute)


__all__ = ["MEGATRON_SHAPE_FLAGS", "follow_node", "job_settings", "megatron_model", "megatron_shape_from_args",
           "megatron_shape_from_argv", "micro_batches_from_args", "preset_node", "preset_shape"]
