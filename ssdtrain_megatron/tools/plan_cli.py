"""``ssdtrain lifespan`` and ``ssdtrain plan``: the analytic model from the command line.

Each ``add_*_parser(subparsers)`` registers one subcommand whose ``func`` default takes the
parsed arguments and returns an exit code; the ``ssdtrain`` entry point dispatches to it.
Flag values are checked by argparse (``argument --flag: ...``); preset contents are checked
here and reported in one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from .cli_types import (PRESET_HELP, byte_count, deprecated_alias, positive_float, preset_arg,
                        size_or_fraction)
from ..plan.lifespan import RETENTION_FACTOR, WAF, WAF_RATED, ssd_lifespan
from ..plan.model import (ModelShape, SaveProfile, estimate_step_time_s, forward_flops_per_layer,
                    head_activation_terms, largest_micro_batch, layer_activation_bytes,
                    layer_activation_terms, peak_activation_bytes, required_write_gbps)
from ..plan.policy import KEEP, LayerMeasurement, LayerPlan, plan_layers
from .plan_budget import DEFAULT_GPU_MEMORY, activation_budget, bandwidth
from .plan_report import _bytes, _duration, print_plan

DEFAULT_GPU_TFLOPS = 150.0
PRESET_SECTIONS = ("model", "parallel", "offload")


# -- argument types (argparse names the flag in its error) -----------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _gb(text: str) -> int:
    """The old --memory-budget-gb: decimal GB of activation memory."""
    return round(positive_float(text) * 1e9)


def _error(command: str, message: str) -> int:
    print(f"ssdtrain {command}: error: {message}", file=sys.stderr)
    return 2


# -- ssdtrain lifespan ------------------------------------------------------------------------


def add_lifespan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ssdtrain lifespan``."""
    parser = subparsers.add_parser(
        "lifespan", help="SSD lifespan for a write rate (decimal units: TB = 1e12, GB = 1e9)",
        description="Lifespan of a set of SSDs written at a given rate. First the rated "
                    "lifespan: drives x TBW / (write-gbps x write-fraction), what the drives' "
                    "rating promises. Then the paper's estimate: the same times the WAF "
                    "correction (waf-rated / waf) and the retention factor, which are "
                    "estimates, not ratings. Decimal units: 1 TB = 1e12 B, 1 GB = 1e9 B.")
    parser.add_argument("--drives", type=_int_at_least(1), required=True,
                        help="number of drives sharing the writes")
    parser.add_argument("--tbw-per-drive", type=positive_float, required=True, metavar="TB",
                        help="rated endurance of each drive, TB written")
    parser.add_argument("--write-gbps", type=positive_float, required=True, metavar="GB/S",
                        help="write bandwidth while writing, GB/s")
    parser.add_argument("--write-fraction", type=_fraction, required=True, metavar="F",
                        help="fraction of the time spent writing, in (0, 1] (0.5: half the step)")
    parser.add_argument("--waf-rated", type=positive_float, default=WAF_RATED,
                        help=f"write amplification the TBW rating assumes (default {WAF_RATED})")
    parser.add_argument("--waf", type=positive_float, default=WAF,
                        help=f"write amplification of the offload writes (default {WAF})")
    parser.add_argument("--retention-factor", type=positive_float, default=RETENTION_FACTOR,
                        help="endurance gain from relaxed retention (default "
                             f"{RETENTION_FACTOR:g})")
    parser.add_argument("--json", action="store_true",
                        help="print {lifespan_years, endurance_bytes, bytes_per_day, "
                             "rated_lifespan_years} as JSON")
    parser.set_defaults(func=run_lifespan)
    return parser


def run_lifespan(args: argparse.Namespace) -> int:
    result = ssd_lifespan(args.drives, args.tbw_per_drive, args.write_gbps, args.write_fraction,
                          waf_rated=args.waf_rated, waf=args.waf,
                          retention_factor=args.retention_factor)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    rows = [
        ("drives", f"{args.drives} x {args.tbw_per_drive:g} TBW"),
        ("write rate", f"{args.write_gbps:g} GB/s x {args.write_fraction:g}"),
        ("bytes per day", _bytes(result.bytes_per_day)),
        ("rated lifespan", f"{_duration(result.rated_lifespan_years)}: the rated "
                           f"{args.drives * args.tbw_per_drive:,g} TB written at "
                           f"{result.bytes_per_day / 1e12:,.1f} TB per day"),
        ("WAF correction", f"{args.waf_rated:g} / {args.waf:g} = {args.waf_rated / args.waf:g}x"),
        ("retention factor", f"{args.retention_factor:g}x"),
        ("endurance", _bytes(result.endurance_bytes)),
        ("lifespan", f"{result.lifespan_years:.4f} years ({result.lifespan_years * 365.25:,.1f} days) "
                     f"= rated x {result.adjustment:g} (WAF correction x retention factor: the "
                     "paper's estimates, not a rating)"),
    ]
    for name, value in rows:
        print(f"{name:<18} {value}")
    return 0


# -- ssdtrain plan ----------------------------------------------------------------------------


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ssdtrain plan``."""
    parser = subparsers.add_parser(
        "plan", help="activation bytes per layer, decisions, required bandwidth, SSD lifespan",
        description="Analytic plan for a preset before a run: activation bytes per layer "
                    "(Korthikanti et al.), keep/offload/recompute per layer, required write "
                    "bandwidth, SSD lifespan and the largest micro-batch within a memory "
                    "budget, for one GPU of the first pipeline stage (under 1F1B it has the "
                    "most micro-batches in flight, and with pp > 1 it also writes their "
                    "deferred last layers). Decimal units: 1 GB = 1e9 B.")
    parser.add_argument("--config", required=True, metavar="PRESET", type=preset_arg,
                        help=f"{PRESET_HELP}, with model:, parallel: and offload: sections")
    parser.add_argument("--micro-batch-size", dest="micro_batch", type=_int_at_least(1), default=None,
                        metavar="N", help="micro-batch size (default: the preset's model.micro_batch)")
    parser.add_argument("--num-microbatches", dest="num_micro_batches", type=_int_at_least(1),
                        default=1, metavar="M",
                        help="micro-batches per step, for the per-step totals (default 1)")
    deprecated_alias(parser, "--micro-batch", "--micro-batch-size", "micro_batch", _int_at_least(1))
    deprecated_alias(parser, "--num-micro-batches", "--num-microbatches", "num_micro_batches",
                     _int_at_least(1))
    parser.add_argument("--gpu-tflops", type=positive_float, default=DEFAULT_GPU_TFLOPS,
                        metavar="X", help="sustained TFLOP/s per GPU for the step-time estimate "
                                          f"(default {DEFAULT_GPU_TFLOPS:g})")
    parser.add_argument("--ssd-gbps", type=positive_float, default=None, metavar="Y",
                        help="SSD read and write bandwidth per GPU, GB/s; when given, layers "
                             "whose IO cannot hide behind compute are kept (default: offload "
                             "all but the last keep_last_layers)")
    parser.add_argument("--recompute-fallback", action="store_true",
                        help="with --ssd-gbps, recompute layers that cannot be offloaded")
    parser.add_argument("--ssd-tbw", type=positive_float, default=None, metavar="TB",
                        help="rated TBW per drive, TB; enables the lifespan estimate")
    parser.add_argument("--gpus-per-node", type=_int_at_least(1), default=8, metavar="G",
                        help="GPUs per node, for the per-node bandwidth (default 8)")
    parser.add_argument("--drives", type=_int_at_least(1), default=None, metavar="K",
                        help="NVMe drives per node sharing the node's writes, for the per-drive "
                             "bandwidth and the lifespan (default: one per GPU, --gpus-per-node)")
    layout = parser.add_argument_group(
        "memory (the largest micro-batch)",
        "Weights, gradients and optimizer state per GPU: 18 bytes per parameter held "
        "(bf16 weights 2, fp32 main grads 4, fp32 main params 4, Adam m and v 8), or with the "
        "distributed optimizer 6 + 12/d (d data-parallel ranks share the 12); "
        "docs/models.md#model-state-and-the-activation-budget.")
    layout.add_argument("--gpu-memory", type=byte_count, default=DEFAULT_GPU_MEMORY,
                        metavar="SIZE", help="memory per GPU, e.g. 80GB or 141GB "
                                             "(default 80GB)")
    layout.add_argument("--activation-budget", type=size_or_fraction, default=None,
                        metavar="SIZE|FRACTION",
                        help="activation memory per GPU for the largest-micro-batch search: a "
                             "size (24GiB) or a fraction of --gpu-memory (0.35); default: the "
                             "preset's activation_budget_bytes, else what the model state "
                             "leaves of --gpu-memory")
    deprecated_alias(layout, "--memory-budget-gb", "--activation-budget", "activation_budget",
                     _gb)
    layout.add_argument("--data-parallel-size", dest="dp", type=_int_at_least(1), default=None,
                        metavar="D", help="model replicas (default: the preset's parallel.dp, "
                                          "else 1)")
    layout.add_argument("--use-distributed-optimizer", dest="distributed_optimizer",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="shard main params and Adam states over the data-parallel ranks "
                             "(default: the preset's parallel.distributed_optimizer)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run_plan)
    return parser


def load_preset(path: str) -> Tuple[ModelShape, int]:
    """(shape, keep_last_layers) from a preset file (see :func:`read_preset`)."""
    shape, offload = read_preset(path)
    return shape, offload.keep_last_layers


def read_preset(path: str) -> Tuple[ModelShape, Any]:
    """(shape, OffloadConfig of its offload: section) from a preset file.

    Raises:
        ValueError: unreadable file, unknown section or key, invalid value; one line that
            names the file and the key.
    """
    import yaml

    from ..config import OffloadConfig

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ValueError(f"--config: cannot read {path!r}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        raise ValueError(f"--config: {path!r} is not valid YAML: "
                         + " ".join(str(exc).split()))
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"{path}: expected a mapping with a model: section")
    unknown = sorted(str(k) for k in data if k not in PRESET_SECTIONS)
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(unknown)}; allowed: "
                         + ", ".join(PRESET_SECTIONS))
    try:
        shape = ModelShape.from_preset(data["model"], data.get("parallel"))
        offload = OffloadConfig.from_dict(data.get("offload") or {}, source="offload")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}")
    return shape, offload


def _layer_measurements(shape: ModelShape, profile: SaveProfile,
                        tflops: float) -> Tuple[LayerMeasurement, ...]:
    forward_s = forward_flops_per_layer(shape) / (shape.tp * shape.cp) / (tflops * 1e12)
    layer = LayerMeasurement(
        forward_s=forward_s,
        activation_bytes=layer_activation_bytes(shape, profile),
        checkpoint_bytes=layer_activation_bytes(shape.replace(recompute="full"), profile,
                                                include_shared=False))
    return (layer,) * shape.layers_per_stage


def _plan_for(shape: ModelShape, profile: SaveProfile, args: argparse.Namespace,
              keep_last_layers: int, full_offload: bool = False) -> LayerPlan:
    """The plan at --ssd-gbps; ``full_offload``: at unlimited bandwidth, every layer but the
    last keep_last_layers offloaded."""
    gbps = None if full_offload else args.ssd_gbps
    bandwidth = math.inf if gbps is None else gbps * 1e9
    return plan_layers(_layer_measurements(shape, profile, args.gpu_tflops),
                       write_bps=bandwidth, read_bps=bandwidth,
                       num_micro_batches=args.num_micro_batches,
                       keep_last_layers=keep_last_layers,
                       recompute_fallback=args.recompute_fallback and gbps is not None)


def _deferred_bytes(shape: ModelShape, keep_last_layers: int, layer_bytes: int) -> int:
    """Bytes of a micro-batch's last ``keep_last_layers`` layers: kept for an immediate
    backward, but written once another micro-batch's forward starts first."""
    return min(keep_last_layers, shape.layers_per_stage) * layer_bytes


def _first_stage_offloaded(plan: LayerPlan, shape: ModelShape, num_micro_batches: int,
                           deferred: int) -> int:
    """Bytes the first pipeline stage writes per step: the plan's offloaded layers, plus, with
    a pipeline (pp > 1), the deferred last layers of every micro-batch but the step's last,
    since under 1F1B the next micro-batch's forward runs before their backward
    (cache/offloader.py ``microbatch``). Without a pipeline backward follows forward."""
    return plan.offloaded_bytes + (deferred * (num_micro_batches - 1) if shape.pp > 1 else 0)


def build_plan(shape: ModelShape, keep_last_layers: int, args: argparse.Namespace,
               profile: SaveProfile = SaveProfile.paper(),
               preset_budget: Any = None) -> Dict[str, Any]:
    """The whole plan as a JSON-ready dict (what ``ssdtrain plan --json`` prints), for the
    first pipeline stage (the most micro-batches in flight)."""
    plan = _plan_for(shape, profile, args, keep_last_layers)
    full = _plan_for(shape, profile, args, keep_last_layers, full_offload=True)
    layer_bytes = layer_activation_bytes(shape, profile)
    deferred = _deferred_bytes(shape, keep_last_layers, layer_bytes)
    offloaded = _first_stage_offloaded(plan, shape, args.num_micro_batches, deferred)
    step_s = estimate_step_time_s(shape, args.gpu_tflops, args.num_micro_batches)
    gpus = getattr(args, "gpus_per_node", 8)
    drives = getattr(args, "drives", None) or gpus
    planned = bandwidth(offloaded, step_s, gpus, drives)
    lifespan: Optional[Dict[str, float]] = None
    if args.ssd_tbw is not None and offloaded > 0:
        # A node's drives share its writes, at the rate that writes them in half the step.
        lifespan = ssd_lifespan(drives, args.ssd_tbw, planned["write_gbps_per_node"],
                                0.5).to_dict()
    memory = activation_budget(shape, args, preset_budget)
    budget = memory["activation_budget_bytes"]

    def fits(mode: str) -> Callable[[int], bool]:
        def check(b: int) -> bool:
            sized = shape.replace(micro_batch=b)
            resident = last = None
            if mode == "offload":
                resident = _plan_for(sized, profile, args, keep_last_layers).resident_bytes
                last = _deferred_bytes(sized, keep_last_layers, layer_activation_bytes(sized, profile))
            return peak_activation_bytes(sized, mode, profile, resident_bytes=resident,
                                         deferred_bytes=last) <= budget
        return check

    return {
        "config": args.config,
        "model": {name: getattr(shape, name) for name in shape.__dataclass_fields__},
        "layers_per_stage": shape.layers_per_stage,
        "keep_last_layers": keep_last_layers,
        # Numbered from 1 within the stage, as Megatron numbers layers (and
        # --ssd-offload-recompute-layers takes them).
        "layers": [{"layer": i, "bytes": layer_bytes, "decision": d}
                   for i, d in enumerate(plan.decisions, start=1)],
        "terms_per_layer": layer_activation_terms(shape, profile),
        "activation_bytes_per_layer": layer_bytes,
        "activation_bytes_per_micro_batch": layer_bytes * shape.layers_per_stage
        + sum(head_activation_terms(shape, profile).values()),
        "offloaded_bytes_per_step": offloaded,
        "resident_bytes_per_micro_batch": plan.resident_bytes,
        # The part of it (the last layers) that only the micro-batch about to run backward keeps.
        "deferred_bytes_per_micro_batch": deferred,
        "gpu_tflops": args.gpu_tflops,
        "num_micro_batches": args.num_micro_batches,
        "step_time_s": step_s,
        "required_write_gbps": planned["write_gbps_per_gpu"],
        "gpus_per_node": gpus,
        "drives_per_node": drives,
        "bandwidth": {"plan": planned,
                      "full_offload": bandwidth(_first_stage_offloaded(full, shape, args.num_micro_batches,
                                                                       deferred), step_s, gpus, drives)},
        "ssd_gbps": args.ssd_gbps,
        "bandwidth_considered": args.ssd_gbps is not None,
        "predicted_io_stall_s": plan.io_stall_s,
        "recompute_s": plan.recompute_s,
        "lifespan": lifespan,
        "memory_budget_bytes": budget,  # the activation budget (older name)
        "memory": memory,
        "largest_micro_batch": {mode: largest_micro_batch(fits(mode))
                                for mode in ("keep", "offload", "recompute")},
        # At the preset's micro-batch, on the first pipeline stage (pp micro-batches in flight).
        "peak_activation_bytes": {
            "keep": peak_activation_bytes(shape, "keep", profile),
            "offload": peak_activation_bytes(shape, "offload", profile,
                                             resident_bytes=plan.resident_bytes, deferred_bytes=deferred),
            "recompute": peak_activation_bytes(shape, "recompute", profile)},
    }


def run_plan(args: argparse.Namespace) -> int:
    try:
        shape, offload = read_preset(args.config)
        changes = {name: getattr(args, flag) for name, flag in
                   (("micro_batch", "micro_batch"), ("dp", "dp"),
                    ("distributed_optimizer", "distributed_optimizer"))
                   if getattr(args, flag, None) is not None}
        shape = shape.replace(**changes)
    except ValueError as exc:
        return _error("plan", str(exc))
    result = build_plan(shape, offload.keep_last_layers, args,
                        preset_budget=offload.activation_budget_bytes)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print_plan(shape, result)
    return 0
