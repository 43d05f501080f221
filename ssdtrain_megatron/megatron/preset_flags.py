"""A preset's ``model:`` and ``parallel:`` sections as Megatron-LM flags, so that a launch
script trains exactly the shape ``ssdtrain plan --config`` planned for.

``python -m ssdtrain_megatron.megatron.args PRESET`` (or ``.preset_flags``) prints them on one
line. Nothing here imports megatron.
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence


def megatron_args_from_preset(path: str) -> List[str]:
    """The Megatron-LM flags for a preset's ``model:`` and ``parallel:`` sections, so that a
    launch script trains exactly the shape that ``ssdtrain plan --config`` planned for.

    Covers the shape, the micro-batch, dtype, grouped-query attention, SwiGLU, dropout,
    mixture of experts (experts, top-k, expert FFN width, EP; the alltoall dispatcher),
    recomputation and the TP / PP / sequence- and context-parallel layout. Everything else about the model
    (position embeddings, normalization, tokenizer, data) stays in the launch script.

    Raises:
        ValueError: the preset is unreadable or invalid (one line naming the file and key).
    """
    import yaml

    from ..plan.model import ModelShape
    from ..presets import UnknownPreset, resolve_preset

    try:
        path = resolve_preset(path, flag="preset")
    except UnknownPreset as exc:
        raise ValueError(str(exc)) from None
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read preset {path!r}: {exc.strerror or exc}") from None
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"{path}: expected a mapping with a model: section")
    try:
        shape = ModelShape.from_preset(data["model"], data.get("parallel"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    flags = ["--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden),
             "--num-attention-heads", str(shape.heads), "--ffn-hidden-size", str(shape.ffn_hidden),
             "--seq-length", str(shape.seq_len),
             "--max-position-embeddings", str(shape.seq_len),
             "--micro-batch-size", str(shape.micro_batch),
             "--attention-dropout", f"{shape.attention_dropout:g}",
             "--hidden-dropout", f"{shape.hidden_dropout:g}",
             "--tensor-model-parallel-size", str(shape.tp),
             "--pipeline-model-parallel-size", str(shape.pp)]
    if shape.kv_groups is not None and shape.kv_groups != shape.heads:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.kv_groups)]
    if shape.kv_channels is not None:
        flags += ["--kv-channels", str(shape.kv_channels)]
    dtype = data["model"].get("dtype")
    if dtype in ("bf16", "fp16"):
        flags.append(f"--{dtype}")
    if shape.swiglu:
        flags.append("--swiglu")
        if not shape.swiglu_fusion:
            flags.append("--no-bias-swiglu-fusion")
    if shape.sequence_parallel:
        flags.append("--sequence-parallel")
    if shape.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if shape.cp > 1:
        flags += ["--context-parallel-size", str(shape.cp)]
    if shape.num_experts is not None:
        flags += ["--num-experts", str(shape.num_experts), "--moe-router-topk",
                  str(shape.moe_topk), "--expert-model-parallel-size", str(shape.ep),
                  "--moe-token-dispatcher-type", "alltoall"]
        if shape.moe_ffn_hidden is not None:
            flags += ["--moe-ffn-hidden-size", str(shape.moe_ffn_hidden)]
    if shape.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif shape.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
    return flags


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ssdtrain_megatron.megatron.args PRESET``: print the preset's Megatron flags
    on one line (for launch scripts: ``MODEL_ARGS=$(python -m ... PRESET)``)."""
    import shlex
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m ssdtrain_megatron.megatron.args",  # the command users know; both work
        description="Print the Megatron-LM flags (shape, micro-batch, dtype, layout) of a "
                    "preset's model: and parallel: sections.")
    parser.add_argument("preset", metavar="PRESET",
                        help="a preset name (llama2-13b) or a YAML file, e.g. configs/llama2-13b.yaml")
    args = parser.parse_args(argv)
    try:
        print(shlex.join(megatron_args_from_preset(args.preset)))
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
