"""Megatron's own flags that move a job's time or memory, read from a command line before
Megatron starts (``ssdtrain plan -- ARGS``, the pre-flight), under Megatron's own attribute
names, so that the same reading works on Megatron's parsed arguments at install.

Each flag is read into the planner's job (plan/shape.py's ModelShape) or refused in one line
that names it (a value the planner does not model), never silently ignored:

* the model: vocab size (padded as Megatron pads it: up to a multiple of
  ``--make-vocab-size-divisible-by`` x tp), attention backend (``--transformer-impl``,
  ``--attention-backend``: fused/flash attention or the unfused s x s one), dropouts;
* the schedule: ``--virtual-pipeline-model-parallel-size`` or
  ``--num-layers-per-virtual-pipeline-stage``;
* precision: ``--fp8-format`` (the GEMMs in FP8);
* overlap: ``--tp-comm-overlap``, ``--overlap-grad-reduce``, ``--overlap-param-gather``,
  ``--grad-reduce-in-bf16``;
* mixture of experts: ``--moe-grouped-gemm``, ``--moe-token-dispatcher-type`` (alltoall or
  flex; allgather refused), ``--moe-expert-capacity-factor`` (refused: dropping tokens is not
  modelled);
* recompute: ``--recompute-activations`` (selective), ``--recompute-granularity``,
  ``--recompute-method`` / ``--recompute-num-layers`` (full recompute of every layer only);
* context parallelism's exchange: ``--cp-comm-type`` p2p (the ring; others refused);
* ``--recompute-modules`` (core_attn only), ``--expert-tensor-parallel-size`` (tp only),
  ``--fp8-param-gather`` (the parameter all-gather in FP8).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

from ..plan.job import JobError

#: Megatron's default ``--make-vocab-size-divisible-by``.
VOCAB_DIVISIBLE_BY = 128


def add_time_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron's flags of the module docstring, under Megatron's dests and defaults (None
    where Megatron's default depends on other flags)."""
    add = parser.add_argument
    add("--vocab-size", dest="vocab_size", type=int, default=None)
    add("--make-vocab-size-divisible-by", dest="make_vocab_size_divisible_by", type=int,
        default=VOCAB_DIVISIBLE_BY)
    add("--transformer-impl", dest="transformer_impl", default="transformer_engine",
        choices=("transformer_engine", "local", "inference_optimized"))
    add("--attention-backend", dest="attention_backend", default="auto",
        choices=("auto", "flash", "fused", "unfused", "local"))
    add("--use-flash-attn", dest="use_flash_attn", action="store_true", default=False)
    add("--attention-dropout", dest="attention_dropout", type=float, default=0.1)
    add("--hidden-dropout", dest="hidden_dropout", type=float, default=0.1)
    add("--virtual-pipeline-model-parallel-size", dest="virtual_pipeline_model_parallel_size",
        type=int, default=None)
    add("--num-layers-per-virtual-pipeline-stage", dest="num_layers_per_virtual_pipeline_stage",
        type=int, default=None)
    add("--fp8-format", dest="fp8", default=None, choices=("e4m3", "hybrid"))
    add("--fp8-recipe", dest="fp8_recipe", default="delayed",
        choices=("delayed", "tensorwise", "mxfp8", "blockwise", "custom"))
    for flag in ("--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather",
                 "--grad-reduce-in-bf16", "--moe-grouped-gemm", "--recompute-activations",
                 "--no-bias-swiglu-fusion"):
        add(flag, dest=flag[2:].replace("-", "_"), action="store_true", default=False)
    add("--moe-token-dispatcher-type", dest="moe_token_dispatcher_type", default="allgather",
        choices=("allgather", "alltoall", "flex"))
    add("--moe-expert-capacity-factor", dest="moe_expert_capacity_factor", type=float,
        default=None)
    add("--recompute-method", dest="recompute_method", default=None, choices=("uniform", "block"))
    add("--recompute-num-layers", dest="recompute_num_layers", type=int, default=None)
    add("--cp-comm-type", dest="cp_comm_type", default="p2p")
    add("--recompute-modules", dest="recompute_modules", nargs="*", default=None)
    add("--expert-tensor-parallel-size", dest="expert_tensor_parallel_size", type=int,
        default=None)
    add("--fp8-param-gather", dest="fp8_param_gather", action="store_true", default=False)


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: ``vocab`` rounded up to a multiple of divisible_by x tp."""
    multiple = max(divisible_by, 1) * tp
    return -(-vocab // multiple) * multiple


def flash_attention(args: Any) -> bool:
    """Whether attention is fused (no s x s tensors): Transformer Engine's (Megatron-LM's
    default) unless ``--attention-backend unfused/local``; the local implementation only with
    ``--use-flash-attn``."""
    if getattr(args, "use_flash_attn", False):
        return True
    backend = getattr(args, "attention_backend", "auto")
    backend = getattr(backend, "name", backend)  # Megatron's AttnBackend enum at install
    return getattr(args, "transformer_impl", None) == "transformer_engine" \
        and str(backend) not in ("unfused", "local")


def virtual_pipeline(args: Any, num_layers: Optional[int], pp: int) -> int:
    """Chunks per pipeline stage, from either of Megatron's two flags (1 without them).

    Raises:
        JobError: the two disagree, or layers per stage are not a multiple of the chunk."""
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    per = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per is not None and num_layers:
        stage = num_layers // max(pp, 1)
        if per < 1 or stage % per:
            raise JobError(f"--num-layers-per-virtual-pipeline-stage {per} does not divide the "
                           f"{stage} layers of a pipeline stage (--num-layers {num_layers} / "
                           f"--pipeline-model-parallel-size {pp})")
        if vp is not None and vp != stage // per:
            raise JobError(f"--virtual-pipeline-model-parallel-size {vp} disagrees with "
                           f"--num-layers-per-virtual-pipeline-stage {per} ({stage // per}): "
                           "give one of them")
        return stage // per
    return vp or 1


def time_fields(args: Any, whole: bool) -> Dict[str, Any]:
    """The ModelShape fields these flags set (module docstring); on a flag group alone
    (``whole`` false) only the flags given.

    Raises:
        JobError: a value the planner does not model, named with the flag (on a command line;
            Megatron's parsed arguments at install are taken as they run)."""
    if hasattr(args, "whole"):  # megatron_namespace's: a command line, before Megatron runs
        _refuse(args)
    found: Dict[str, Any] = {}
    fp8 = getattr(args, "fp8", None)
    if fp8 or whole:
        found["fp8"] = bool(fp8)
    for name in ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather",
                 "grad_reduce_in_bf16", "moe_grouped_gemm", "fp8_param_gather"):
        value = getattr(args, name, None)
        if value or (whole and value is not None):
            found[name] = bool(value)
    if getattr(args, "no_bias_swiglu_fusion", False):
        found["swiglu_fusion"] = False
    elif getattr(args, "bias_swiglu_fusion", None) is False:  # Megatron's parsed name
        found["swiglu_fusion"] = False
    return found


def _refuse(args: Any) -> None:
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if getattr(args, "num_experts", None) and dispatcher == "allgather":
        raise JobError("--moe-token-dispatcher-type allgather: not modelled (the planner prices "
                       "the alltoall dispatcher's all-to-all); give --moe-token-dispatcher-type "
                       "alltoall or flex")
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        raise JobError(f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor}: "
                       "dropping tokens is not modelled; plan without it (dropless)")
    cp_type = getattr(args, "cp_comm_type", "p2p") or "p2p"
    if isinstance(cp_type, list):
        cp_type = cp_type[0] if len(set(cp_type)) == 1 else "mixed"
    if (getattr(args, "context_parallel_size", 1) or 1) > 1 and cp_type != "p2p":
        raise JobError(f"--cp-comm-type {cp_type}: not modelled (the planner prices the p2p "
                       "ring's key/value exchange); give --cp-comm-type p2p")
    modules = getattr(args, "recompute_modules", None)
    if getattr(args, "recompute_granularity", None) == "selective" and modules \
            and list(modules) != ["core_attn"]:
        raise JobError(f"--recompute-modules {' '.join(modules)}: only core_attn (Megatron's "
                       "default selective recompute) is modelled; drop the flag")
    etp = getattr(args, "expert_tensor_parallel_size", None)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if getattr(args, "num_experts", None) and etp is not None and etp != tp:
        raise JobError(f"--expert-tensor-parallel-size {etp}: the planner splits experts over "
                       f"tp ({tp}), Megatron's default; give {tp} or leave the flag out")
    method, count = getattr(args, "recompute_method", None), getattr(args, "recompute_num_layers", None)
    if getattr(args, "recompute_granularity", None) == "full" and method is not None \
            and count is not None:
        num_layers, pp = getattr(args, "num_layers", None), getattr(args, "pipeline_model_parallel_size", 1) or 1
        stage = num_layers // pp if num_layers else None
        if method == "block" and stage is not None and count < stage:
            raise JobError(f"--recompute-method block --recompute-num-layers {count}: recomputing "
                           f"{count} of a stage's {stage} layers is not modelled; plan with "
                           f"--recompute-num-layers {stage}, or selective recompute")


__all__ = ["VOCAB_DIVISIBLE_BY", "add_time_flags", "flash_attention", "padded_vocab",
           "time_fields", "virtual_pipeline"]
