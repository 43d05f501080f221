"""``ssdtrain lifespan`` and ``ssdtrain plan``: the analytic model from the command line.

Each ``add_*_parser(subparsers)`` registers one subcommand whose ``func`` default takes the
parsed arguments and returns an exit code; the ``ssdtrain`` entry point dispatches to it.
Flag values are checked by argparse (``argument --flag: ...``); preset contents are checked
here and reported in one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable, Optional, Tuple

from ...plan.engine_choice import size as size_text
from ...plan.lifespan import RETENTION_FACTOR, WAF, WAF_RATED, ssd_lifespan
from ...plan.node import NodeProfile
from ...plan.shape import ModelShape
from ..cli_types import (PRESET_HELP, deprecated_alias, positive_float, preset_arg, size_with_unit,
                         size_with_unit_or_fraction, size_with_unit_zero_or_fraction)
from .report import _bytes, _duration, faster_with, print_plan

from ...plan.preset_file import SECTIONS as PRESET_SECTIONS


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


def _node_arg(text: str) -> NodeProfile:
    """--node: a built-in profile's name or a profile file, read at once (argparse names the
    flag in the one-line error)."""
    from ...plan.node import load_profile

    try:
        return load_profile(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_origin(args: argparse.Namespace, node: NodeProfile) -> str:
    """Where the plan's host memory per GPU comes from: --host-memory, else the profile."""
    return "--host-memory" if getattr(args, "host_memory", None) is not None else node.name


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
    from ...config import ENGINES, POLICIES
    from ...plan.node import BUILTIN

    parser = subparsers.add_parser(
        "plan", help="a preset on a node: keep, host, SSD or recompute per layer, bandwidth, "
                     "iteration time, lifespan; --search ranks layouts",
        description="Analytic plan for a preset on a node, before a run: activation bytes per "
                    "layer (Korthikanti et al.), and per layer keep, host memory, SSD or "
                    "recompute as the policy, engine and recompute fallback allow (the flags, "
                    "else the preset's; an engine neither names follows the node's host memory "
                    "per GPU, as at a job's start, and with tiered so do the policy and fallback "
                    "neither names), chosen to minimise the modeled iteration time within the "
                    "activation budget and the host memory, with each tier's bandwidth (the "
                    "host link carries the SSD tier's bytes too). For one GPU of the first "
                    "pipeline stage (under 1F1B it has the most micro-batches in flight). "
                    "Figures are the model's, not measurements. Decimal units: 1 GB = 1e9 B.")
    parser.add_argument("--config", default=None, metavar="PRESET", type=preset_arg,
                        help=f"{PRESET_HELP}, with model:, parallel:, offload: (and node:) "
                             "sections; not needed with the job's arguments after -- (their "
                             "--ssd-offload-config)")
    parser.add_argument("launch_args", nargs="*", metavar="-- LAUNCHER_ARGS",
                        help="the job's own launcher arguments (Megatron's flags and the "
                             "--ssd-offload flags, as ssdtrain-pretrain gets them): plan exactly "
                             "what the job will run (the settings `ssdtrain doctor --preflight "
                             "--json -- ARGS` prints per rank); without --ssd-offload, the job "
                             "as Megatron runs it (keeping everything: job_tokens_per_s_per_gpu "
                             "in --json). --node, --gpus (the world size) "
                             "and --host-memory (per GPU, staging included) still apply")
    parser.add_argument("--node", default=None, metavar="NAME|PATH", type=_node_arg,
                        help="the node: a built-in profile (" + ", ".join(BUILTIN) + ") or a "
                             "profile file (ssdtrain doctor --node-profile writes one); default: "
                             "the preset's node: section, else dgx-h100")
    parser.add_argument("--micro-batch-size", dest="micro_batch", type=_int_at_least(1), default=None,
                        metavar="N", help="micro-batch size (default: the preset's model.micro_batch)")
    parser.add_argument("--num-microbatches", dest="num_micro_batches", type=_int_at_least(1),
                        default=None, metavar="M",
                        help="micro-batches per iteration (default: --global-batch-size over "
                             "micro-batch x data-parallel size, else 1); times are per iteration")
    parser.add_argument("--global-batch-size", type=_int_at_least(1), default=None, metavar="B",
                        help="sequences per iteration, as Megatron's flag (a multiple of "
                             "micro-batch x data-parallel size); --search ranks layouts at it "
                             "(default: dp x micro-batch x --num-microbatches, said in the "
                             "first line)")
    parser.add_argument("--gpus", type=_int_at_least(1), default=None, metavar="N",
                        help="GPUs of the job (a multiple of the preset's tp x pp x cp: its "
                             "data-parallel size follows); --search ranks layouts on them "
                             "(default: the preset's dp x tp x pp x cp, said in the first line)")
    parser.add_argument("--nodes", type=_int_at_least(1), default=None, metavar="K",
                        help="nodes of the job: K x --gpus-per-node GPUs (the node profile's "
                             "unless given)")
    deprecated_alias(parser, "--micro-batch", "--micro-batch-size", "micro_batch", _int_at_least(1))
    deprecated_alias(parser, "--num-micro-batches", "--num-microbatches", "num_micro_batches",
                     _int_at_least(1))
    parser.add_argument("--policy", choices=POLICIES, default=None,
                        help="keep, offload (every layer but the last keep_last_layers leaves "
                             "GPU memory) or adaptive (what the budget needs); default: the preset's, "
                             "else offload, or adaptive where the node chooses tiered and the "
                             "preset sets activation_budget_bytes or memory_budget_bytes")
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="where offloaded bytes go: posix/aio/gds the drives, memory host "
                             "memory, tiered both; default: the preset's, else the node's: tiered "
                             "where its host memory per GPU holds one layer's activations, else "
                             "posix")
    parser.add_argument("--recompute-fallback", action=argparse.BooleanOptionalAction,
                        default=None, help="recompute is a place a layer may go (default: the "
                                           "preset's recompute_fallback, else off; on where the "
                                           "node chooses tiered and the policy is adaptive)")
    parser.add_argument("--search", action="store_true",
                        help="rank layouts (tp, pp, vp, cp, micro-batch, recompute, distributed "
                             "optimizer, tier plan) of the preset's (or the job's, after --) "
                             "model on --gpus at --global-batch-size by modeled tokens/s per GPU, "
                             "without and with offload (only plans that offload rank with it)")
    parser.add_argument("--top", type=_int_at_least(1), default=5, metavar="K",
                        help="--search: layouts shown per kind (default 5)")
    _add_node_flags(parser)
    layout = parser.add_argument_group(
        "memory",
        "Weights, gradients and optimizer state per GPU: 18 bytes per parameter held "
        "(bf16 weights 2, fp32 main grads 4, fp32 main params 4, Adam m and v 8), or with the "
        "distributed optimizer 6 + 12/d (d data-parallel ranks share the 12); "
        "docs/models.md#model-state-and-the-activation-budget.")
    layout.add_argument("--activation-budget", type=size_with_unit_or_fraction, default=None,
                        metavar="SIZE|FRACTION",
                        help="activation memory per GPU: a size (24GiB) or a fraction of GPU "
                             "memory (0.35); default: the preset's activation_budget_bytes, "
                             "else what the model state leaves of GPU memory")
    deprecated_alias(layout, "--memory-budget-gb", "--activation-budget", "activation_budget",
                     _gb)
    layout.add_argument("--data-parallel-size", dest="dp", type=_int_at_least(1), default=None,
                        metavar="D", help="model replicas (default: the preset's parallel.dp, "
                                          "else 1)")
    layout.add_argument("--use-distributed-optimizer", dest="distributed_optimizer",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="shard main params and Adam states over the data-parallel ranks "
                             "(default: the preset's parallel.distributed_optimizer)")
    layout.add_argument("--memory-reserve", type=size_with_unit_zero_or_fraction, default=None,
                        metavar="SIZE|FRACTION",
                        help="GPU memory no plan uses, per GPU: the CUDA context, NCCL and "
                             "fragmentation; a size (5GB, 0B) or a fraction of GPU memory "
                             "(0.06); default 5GB (docs/models.md#does-the-job-fit)")
    layout.add_argument("--job-days", type=positive_float, default=None, metavar="DAYS",
                        help="the job's length, which the drives' rated life must cover for a "
                             "micro-batch to count as runnable (default 30)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run_plan)
    return parser


def _add_node_flags(parser: argparse.ArgumentParser) -> None:
    """The node's figures, each replacing the profile's (build.node_for)."""
    node = parser.add_argument_group(
        "the node's figures (each replaces the profile's)",
        "Per GPU unless said: achieved TFLOP/s in Megatron, memory, host memory for "
        "activations and the host link each way; per node: GPUs and drives; per drive: TBW.")
    node.add_argument("--gpu-tflops", type=positive_float, default=None, metavar="X",
                      help="achieved bf16 TFLOP/s per GPU")
    node.add_argument("--gpu-memory", type=size_with_unit, default=None, metavar="SIZE",
                      help="memory per GPU with its unit, e.g. 80GB or 141GB")
    node.add_argument("--host-memory", type=size_with_unit, default=None, metavar="SIZE",
                      help="host memory per GPU for activations, e.g. 150GB (0B: no host tier)")
    node.add_argument("--host-link-gbps", type=positive_float, default=None, metavar="GB/S",
                      help="GPU <-> host GB/s per GPU, each way")
    node.add_argument("--ssd-gbps", type=positive_float, default=None, metavar="Y",
                      help="drive read and write GB/s per GPU (the node's drives shared)")
    node.add_argument("--ssd-tbw", type=positive_float, default=None, metavar="TB",
                      help="rated TBW per drive, TB")
    node.add_argument("--gpus-per-node", type=_int_at_least(1), default=None, metavar="G",
                      help="GPUs per node (they share its drives)")
    node.add_argument("--drives", type=_int_at_least(0), default=None, metavar="K",
                      help="NVMe drives per node (0: no SSD tier)")


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
    from ...plan.preset_file import read_preset as read

    preset = read(path, strict=True)
    try:
        return preset.shape(), preset.config(source="offload")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


PLAN_FLAGS = {"engine": "--engine", "policy": "--policy", "recompute_fallback": "--recompute-fallback",
              "activation_budget_bytes": "--activation-budget"}
"""The OffloadConfig fields ``ssdtrain plan`` has a flag for, and the flag (its own spelling of
the job's --ssd-offload-* flags)."""


class FitAnswered(Exception):
    """The fit answer (the job does not fit, and what would) was printed: exit with ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def plan_job(args: argparse.Namespace):
    """The Job ``ssdtrain plan`` plans from its own flags, with its size (job_size.JobSize).

    Raises:
        ValueError: the preset, the node or the job's size is invalid (one line).
    """
    from ...plan.job import Job
    from ...plan.preset_file import read_preset as read
    from .build import node_for
    from .fit_answer import refuse_unfit
    from .job_size import job_size

    preset = read(args.config, strict=True)
    try:
        shape, offload = preset.shape(), preset.config(source="offload")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{args.config}: {exc}") from None
    node_section = preset.node_profile()  # its messages name the file
    changes = {name: getattr(args, flag) for name, flag in
               (("micro_batch", "micro_batch"), ("dp", "dp"),
                ("distributed_optimizer", "distributed_optimizer"))
               if getattr(args, flag, None) is not None}
    shape = shape.replace(**changes)
    node, source = node_for(args, node_section)
    if not args.search:  # fit first (plan/fit.py): a job that does not fit says so, and what would
        unfit = refuse_unfit(shape, args, node)
        if unfit is not None:
            raise FitAnswered(unfit)
    size = job_size(shape, args, node, search=args.search)
    given = {name: "the preset" for name in preset.fields()}
    values = {"engine": args.engine, "policy": args.policy,
              "recompute_fallback": args.recompute_fallback,
              "activation_budget_bytes": getattr(args, "activation_budget", None)}
    values = {k: v for k, v in values.items() if v is not None}
    given.update({k: PLAN_FLAGS[k] for k in values})
    offload = offload.replace(**values) if values else offload
    named_m = args.num_micro_batches is not None or args.global_batch_size is not None
    job = Job(offload, given, shape.replace(dp=size.dp) if size.dp else shape, node,
              node.host_memory_bytes, f"{size_text(node.host_memory_bytes)} host memory per "
              f"GPU ({_host_origin(args, node)})", size.num_micro_batches if named_m else None,
              memory_reserve=args.memory_reserve)
    return job, size, source


def launcher_job(args: argparse.Namespace):
    """The Job of the launcher arguments after ``--``, read by the launcher's own door
    (megatron/follow_node.py), on --node (else --ssd-offload-node, the preset's, dgx-h100) with
    --host-memory (else the node's) per GPU and --gpus (or --nodes) as the world size.

    Raises:
        ValueError: the flags, the preset or the layout are invalid (one line).
    """
    import dataclasses

    from ...megatron.follow_node import job_from_args, megatron_namespace
    from ...megatron.preflight import parse_flags
    from ...plan.node import load_profile
    from ...plan.preset_file import preset_of
    from .build import node_for

    if args.memory_reserve is not None:
        raise ValueError("--memory-reserve: the job's launcher has no such flag, so the job runs "
                         "with the default reserve; plan the preset with --config to try another")
    flags = parse_flags(args.launch_args)
    if args.config is not None and flags.ssd_offload_config is None:
        flags.ssd_offload_config = args.config
    preset = preset_of(flags.ssd_offload_config) if flags.ssd_offload_config else None
    if args.node is not None:
        base = None  # node_for takes --node
    elif flags.ssd_offload_node is not None:
        base = load_profile(flags.ssd_offload_node)
    else:
        base = preset.node_profile() if preset else None
    node, source = node_for(args, base)
    world = args.gpus or (args.nodes * node.gpus_per_node if args.nodes else None)
    job = job_from_args(flags, megatron_namespace(args.launch_args, world), None, node=node)
    job = dataclasses.replace(job, host_bytes=node.host_memory_bytes,
                              host_text=f"{size_text(node.host_memory_bytes)} host memory per "
                                        f"GPU ({_host_origin(args, node)})")
    if not flags.ssd_offload:  # a plain Megatron command line: the job keeps everything
        job = dataclasses.replace(job, offload=job.offload.replace(policy="keep"),
                                  given={**job.given, "policy": "no --ssd-offload"})
    return job, source


def host_memory_words(job: Any, settings: Any, args: argparse.Namespace) -> dict:
    """The host memory the plan used and where it came from (``host_capacity_bytes``,
    ``host_memory_source``): a named pool bounds the host places (plan/job.py), and what
    megatron-core's optimizer CPU offload takes is not ours (rule 0)."""
    from ...plan.job import less_optimizer_host
    origin = "--host-memory" if getattr(args, "host_memory", None) is not None else \
        f"the {job.node.name} profile's; a job measures its node's at start"
    total = f"{size_text(job.host_bytes or 0)} per GPU ({origin})"
    left = less_optimizer_host(job)  # what megatron-core's optimizer CPU offload leaves (rule 0)
    if left.host_bytes != job.host_bytes:
        total += (f", less {size_text((job.host_bytes or 0) - (left.host_bytes or 0))} for "
                  "megatron-core's optimizer CPU offload")
    job = left
    staging = settings.config.staging_bytes()
    if settings.config.engine in ("tiered", "memory") and "host_memory_bytes" in job.given:
        return {"host_capacity_bytes": settings.config.host_memory_bytes,
                "host_memory_source": f"the host pool named by {job.given['host_memory_bytes']}, "
                                      f"of {total}; what it cannot hold is planned on the drives"}
    return {"host_capacity_bytes": max((job.host_bytes or 0) - staging, 0),
            "host_memory_source": f"{total} less {size_text(staging)} of pinned staging"}


def launched_size(job, args: argparse.Namespace):
    """The GPUs and global batch of the job after ``--`` (for --search)."""
    from .job_size import JobSize

    shape = job.shape
    if shape is None:
        raise ValueError("--search: no model in the arguments after -- (Megatron's --num-layers, "
                         "--hidden-size, --num-attention-heads, --seq-length, --micro-batch-size)")
    m = job.num_micro_batches or 1
    gpus = shape.dp * shape.model_parallel
    return JobSize(gpus, shape.dp * shape.micro_batch * m, shape.dp, m,
                   "" if args.gpus or args.nodes else f"{gpus} GPUs = dp {shape.dp} x tp "
                   f"{shape.tp} x pp {shape.pp} x cp {shape.cp} (--gpus: the world size)")


def job_throughput(job, settings, size) -> dict:
    """The job as given (plan/answer.py): its tokens/s per GPU whether or not it fits (plan/fit.py
    says that), and the step's seconds by term (plan/step_time.py)."""
    from ...plan.answer import job_as_given

    return job_as_given(job, settings, size.gpus, size.global_batch)


def run_plan(args: argparse.Namespace) -> int:
    from ...megatron.preflight import FlagError
    from ...plan.job import job_settings
    from .build import build_plan
    from .fit_answer import as_planned, fit_line
    from .headline import against_without_offload, headline, job_words, micro_batch_source

    from ..refusal import refuse

    if args.config is None and not args.launch_args:
        return refuse("plan", "give --config PRESET, or the job's launcher arguments after --",
                      args.json)
    if args.search and args.micro_batch is not None:
        return refuse("plan", f"--micro-batch-size {args.micro_batch}: --search ranks every "
                              "micro-batch of every layout; give no --micro-batch-size with "
                              "--search, or plan that micro-batch without --search", args.json)
    try:
        if args.launch_args:
            job, source = launcher_job(args)
            size = launched_size(job, args) if args.search else None
        else:
            job, size, source = plan_job(args)
        if args.search:
            from .search import run_search

            return run_search(job.shape, job.offload, args, job.node, source, size)
        if job.shape is None:
            raise ValueError("no model to plan: give --ssd-offload-config a preset with a "
                             "model: section, or Megatron's --num-layers, --hidden-size, "
                             "--num-attention-heads, --seq-length and --micro-batch-size")
        settings = job_settings(job)
    except FitAnswered as answered:
        return answered.code
    except (ValueError, FlagError) as exc:
        return refuse("plan", str(exc), args.json)
    result = build_plan(job, settings, args, source)
    shape = job.shape
    if size is None:
        from .job_size import JobSize

        gpus = shape.dp * shape.model_parallel
        size = JobSize(gpus, shape.dp * shape.micro_batch * settings.num_micro_batches,
                       shape.dp, settings.num_micro_batches,
                       "" if args.gpus or args.nodes else f"{gpus} GPUs = dp {shape.dp} x "
                       f"tp {shape.tp} x pp {shape.pp} x cp {shape.cp} (--gpus: the world size)")
    if args.launch_args and job.num_micro_batches is None:
        size = dataclasses.replace(size, assumed="; ".join(p for p in (
            size.assumed, f"{settings.num_micro_batches} micro-batch(es), the pipeline's depth: the "
            "arguments after -- give no --global-batch-size") if p))
    result.update(gpus=size.gpus, global_batch=size.global_batch, assumed=size.assumed)
    result.update(host_memory_words(job, settings, args))
    result.update(job_throughput(job, settings, size))
    result["fit"] = fit_line(shape, args, job.node, size.num_micro_batches)
    # the headline: against the best that runs without offload on these GPUs (headline.py)
    result["without_offload"] = against_without_offload(shape, args, job.node, result,
                                                         settings.config.keep_last_layers)
    unfit = as_planned(result)
    result["fits_as_planned"] = unfit is None
    job_text = job_words(size.describe(shape.seq_len), shape.micro_batch, micro_batch_source(args),
                         settings.num_micro_batches)
    faster = faster_with(result)
    result["first_line"] = (f"{result['fit']}" if unfit is None else unfit) \
        + f"; {headline(result['without_offload'])}" + (f"; {faster}" if faster else "") \
        + f"; {job_text}"
    if args.launch_args:  # the answer, one value (plan/answer.py): the job, both bests, the error
        from ...plan.answer import answer
        from .fit_answer import reserve_of

        result["answer"] = answer(job, size.gpus, size.global_batch, settings,
                                  reserve_of(args, job.node)).to_dict()
        result["with_offload"] = result["answer"]["best_with_offload"]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print_plan(shape, result, first=result["first_line"])
    return 0
