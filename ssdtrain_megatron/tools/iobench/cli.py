"""``ssdtrain io-bench``: the IO engines against the drive's own limit, measured in one run.

The baseline is what fio would report for the device: an O_DIRECT file preallocated before
the clock starts, several threads each keeping one large (8 MiB) pwrite/pread in flight, no
copies. Each engine writes and reads the same bytes as tensors of ``--tensor-mib``, through
its public interface, with at most ``max_inflight_bytes`` (1 GiB) in flight as the offloader
would, one step per segment after an untimed first step (iobench/engine_side.py). The
report gives, for write and read: GB/s (10^9 bytes per second), the ratio to the baseline, and
the CPU time the calling (training) thread spent per GB; plus ``cpu_us_per_tensor``, the
calling thread's CPU time inside one ``write``/``read`` call (the larger of the two means).

How the two sides are set against each other (rounds.py): in each round, segments of about
``--segment-mib`` in the order baseline, engine, engine, baseline, repeated until each side has
moved ``--total-gib``; each side's bytes and seconds summed; the ratio is the engine's GB/s over
the baseline's in that round. A drive's drift, its bursts after a pause and its dependence on
the writer before cost both sides the same there. Both write into fresh preallocated space:
the engine into a new slab each step, as training does (the slab is removed at the end of every
step), the baseline into a new file each segment. And both move each byte from and into the
same memory (measure.py ``BenchMemory``): the size of the requests a drive gets depends on
the physical layout of the memory, which differs from one allocation to the next. Every figure
is a median over ``--rounds`` rounds, each of which starts with another engine.

Reads are O_DIRECT everywhere, so they come from the drive and not the page cache; where a
filesystem refuses O_DIRECT the report says so on stderr and ``page_cache_bypassed`` is false.
Progress goes to stderr; stdout gets the table, or with ``--json`` one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

from ...config import ConfigError, OffloadConfig
from ..cli_types import (EnvironmentProblem, UsageError, check_engine, deprecated_alias, positive_float,
                         positive_int, verify_methods, writable_dir)
from .engine_side import EngineSide, contender_label
from .measure import BASELINE_BLOCK, BASELINE_THREADS, GiB, MiB, BaselineSide, BenchError, Progress
from .rounds import Round, measure_round, segment_sizes

ENGINE_CHOICES = ("posix", "aio", "memory", "tiered", "gds", "all")
SEGMENT_MIB = 256.0
"""Default size of one segment of the ABBA schedule (rounds.py): short enough that a round
has many, long enough that a step's start and end are a small part of it."""
ALL_ENGINES = ("posix", "aio", "memory")


# -- report --------------------------------------------------------------------------------


def _runnable(engines: List[str], progress: Progress, skipped: Dict[str, str]) -> List[str]:
    """The engines that can run here; the others are reported, with why, in ``skipped``."""
    from ...io import engine_class

    runnable = []
    for name in engines:
        ok, why = engine_class(name).is_available()
        if ok:
            runnable.append(name)
        else:
            progress.say(f"skipping {name}: {why}")
            skipped[name] = why
    if "aio" in runnable:
        progress.say("aio: loading DeepSpeed's async_io op (the first build takes minutes)")
    return runnable


class _Rounds:
    """Every engine's rounds (``rounds.Round``: its ABBA segments) and the baseline's
    O_DIRECT status."""

    def __init__(self, scratch: str, runnable: List[str], progress: Progress) -> None:
        self.scratch = scratch
        self.progress = progress
        self.rounds: Dict[str, List[Round]] = {n: [] for n in runnable}
        self.page_cache_bypassed: Dict[str, bool] = {}

    def bypassed(self, label: str, engine: bool, baseline: bool) -> None:
        """Whether the reads of ``label`` and of the baseline came from the drive."""
        if not baseline and self.page_cache_bypassed.get("baseline", True):
            self.progress.say(f"WARNING: {self.scratch} refuses O_DIRECT; buffered IO with fadvise(DONTNEED) "
                              f"is used and reads MAY BE SERVED BY THE PAGE CACHE")
        for key, ok in ((label, engine), ("baseline", baseline)):
            self.page_cache_bypassed[key] = self.page_cache_bypassed.get(key, True) and ok

    def add(self, label: str, got: Round) -> None:
        self.rounds[label].append(got)
        e, b = got.total("engine"), got.total("baseline")
        self.progress.say(f"{label}: write {e.gbps('write'):.2f} GB/s vs baseline {b.gbps('write'):.2f} "
                          f"(ratio {got.ratio('write'):.2f}), read {e.gbps('read'):.2f} vs "
                          f"{b.gbps('read'):.2f} ({got.ratio('read'):.2f}); {len(got.segments)} segments")


def _contenders(engines: List[str], verify: List[str], base: OffloadConfig,
                skipped: Dict[str, str]) -> Dict[str, Tuple[str, OffloadConfig]]:
    """{label: (engine, config)}: each engine once per ``verify`` value ('posix',
    'posix+crc32c'); a combination the config refuses (memory has no file to verify) is
    reported in ``skipped`` with the reason."""
    out: Dict[str, Tuple[str, OffloadConfig]] = {}
    for name in engines:
        for v in verify:
            label = contender_label(name, v)
            try:
                out[label] = (name, base.replace(engine=name, verify=v))
            except ConfigError as exc:
                skipped[label] = exc.allowed or str(exc)
    return out


def verify_cost(engines: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    """Per engine measured both ways: crc32c against off, as ratios of GB/s and of GB per
    core-second (< 1: verification costs that much)."""
    out = {}
    for label, on in engines.items():
        name, _, v = label.partition("+")
        off = engines.get(name)
        if v and off is not None:
            out[label] = {f"{op}_{k}_ratio": on[f"{op}_{k}"] / max(off[f"{op}_{k}"], 1e-12)
                          for op in ("write", "read") for k in ("gbps", "gb_per_core_s")}
    return out


def _measure_rounds(m: _Rounds, runnable: List[str], rounds: int, sizes: List[int], tensor_bytes: int,
                    configs: Dict[str, Tuple[str, OffloadConfig]], skipped: Dict[str, str]) -> None:
    """Each round: each engine in turn, built and warmed up, then ABBA segments against the
    baseline (rounds.py). An engine that turns out unavailable when built is dropped from
    ``runnable`` and reported in ``skipped``."""
    from ...io.base import EngineUnavailable

    progress = m.progress
    for r in range(rounds):
        # Each round starts with another engine, so that none is always the one after a pause.
        order = runnable[r % len(runnable):] + runnable[:r % len(runnable)] if runnable else []
        progress.say(f"round {r + 1}/{rounds}: " + " | ".join(
            f"{n}: {len(sizes) // 2} x (baseline {n} {n} baseline)" for n in order))
        for name in order:
            engine, cfg = configs[name]
            try:
                side = EngineSide(engine, m.scratch, tensor_bytes, max(sizes), progress, cfg)
            except EngineUnavailable as exc:
                why = str(exc).replace(f"engine {engine!r} cannot run here: ", "")
                progress.say(f"skipping {name}: {why}")
                skipped[name] = why
                runnable.remove(name)
                continue
            baseline = BaselineSide(side.memory)  # the engine's memory (measure.BenchMemory)
            try:
                m.add(name, measure_round(baseline, side, m.scratch, sizes, progress))
                m.bypassed(name, side.page_cache_bypassed, baseline.direct)
            finally:
                baseline.close()
                side.close()


def _summarize(m: _Rounds, runnable: List[str], report: Dict[str, object]) -> None:
    """The medians over rounds into ``report``: baseline, engines, page_cache_bypassed."""
    every = [got for name in runnable for got in m.rounds[name]]
    report["baseline"] = {f"{op}_gbps": statistics.median(got.total("baseline").gbps(op) for got in every)
                          for op in ("write", "read")} if every else {"write_gbps": 0.0, "read_gbps": 0.0}
    bypassed = m.page_cache_bypassed.get("baseline", True)
    engines_out: Dict[str, Dict[str, object]] = {}
    for name in runnable:
        got = m.rounds[name]
        totals = [g.total("engine") for g in got]
        detail: Dict[str, object] = {k: statistics.median(t.engine_figures()[k] for t in totals)
                                     for k in totals[0].engine_figures()}
        for op in ("write", "read"):
            ratios = [g.ratio(op) for g in got]
            detail[f"{op}_gbps"] = statistics.median(t.gbps(op) for t in totals)
            detail[f"{op}_ratio"] = statistics.median(ratios)
            detail[f"{op}_ratio_range"] = (min(ratios), max(ratios))
            detail[f"{op}_ratio_rounds"] = ratios
        report["_detail"][name] = detail
        engines_out[name] = {
            "write_gbps": detail["write_gbps"], "read_gbps": detail["read_gbps"],
            "write_ratio": detail["write_ratio"], "read_ratio": detail["read_ratio"],
            "cpu_us_per_tensor": max(detail["write_call_us"], detail["read_call_us"]),
            "write_gb_per_core_s": detail["write_gb_per_core_s"],
            "read_gb_per_core_s": detail["read_gb_per_core_s"],
            "write_ratio_rounds": detail["write_ratio_rounds"],
            "read_ratio_rounds": detail["read_ratio_rounds"],
            "segments": [[{"side": side, "write_gbps": s.gbps("write"), "read_gbps": s.gbps("read")}
                          for side, s in g.segments] for g in got],
        }
        if name != "memory" and not m.page_cache_bypassed.get(name, True):
            m.progress.say(f"WARNING: {name} read through the page cache; its read figures are inflated")
            bypassed = False
    report["engines"] = engines_out
    if any("+" in label for label in engines_out):
        report["verify_cost"] = verify_cost(engines_out)
    report["page_cache_bypassed"] = bypassed


def run(directory: str, engines: List[str], tensor_mib: float, total_gib: float,
        progress: Progress, compare_layout: bool = False, rounds: int = 1,
        base_config: Optional[OffloadConfig] = None, verify: Optional[List[str]] = None,
        segment_mib: float = SEGMENT_MIB) -> Dict[str, object]:
    """Measure each engine against the baseline, ``rounds`` times (the drive's speed drifts;
    each figure is the median over rounds), each engine once per ``verify`` value (default:
    the config's). Returns the report: the --json object plus private keys, starting with
    '_', for the table."""
    tensor_bytes = int(round(tensor_mib * MiB))
    # At least two tensors: one per segment of the engine's two in a quad.
    n_tensors = max(2, int(round(total_gib * GiB / max(tensor_bytes, 1))))
    sizes = segment_sizes(n_tensors, tensor_bytes, int(segment_mib * MiB))
    total = n_tensors * tensor_bytes
    os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="ssdtrain-iobench.", dir=directory)
    report: Dict[str, object] = {"_skipped": {}, "_detail": {}, "_n_tensors": n_tensors,
                                 "_total": total, "_dir": directory, "_rounds": rounds}
    try:
        base = base_config or OffloadConfig()
        configs = _contenders(_runnable(engines, progress, report["_skipped"]), verify or [base.verify],
                              base, report["_skipped"])
        runnable = list(configs)
        m = _Rounds(scratch, runnable, progress)
        _measure_rounds(m, runnable, rounds, sizes, tensor_bytes, configs, report["_skipped"])
        _summarize(m, runnable, report)
        report["tensor_mib"] = tensor_mib
        report["method"] = {"order": "ABBA", "segments_per_side": len(sizes),
                            "segment_mib": max(sizes) * tensor_bytes / MiB, "space": "fresh, preallocated"}
        if compare_layout:
            from .layout_compare import layout_compare

            progress.say("layout: one slab vs one file per tensor")
            report["layout"] = layout_compare(scratch, n_tensors, tensor_bytes, base.io_threads, base.chunk_bytes)
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def public(report: Dict[str, object]) -> Dict[str, object]:
    """The --json object: the report without its private keys."""
    return {k: report[k] for k in ("baseline", "engines", "verify_cost", "tensor_mib", "page_cache_bypassed",
                                   "method", "layout")
            if k in report}


def format_table(report: Dict[str, object]) -> str:
    base = report["baseline"]
    lines = [
        f"io-bench {report['_dir']}: {report['_n_tensors']} tensors x {report['tensor_mib']:g} MiB "
        f"= {report['_total'] / GiB:.2f} GiB per engine; reads "
        + ("bypass the page cache (O_DIRECT)" if report["page_cache_bypassed"]
           else "MAY COME FROM THE PAGE CACHE (O_DIRECT refused)"),
        "",
        f"{'':<14}{'write GB/s':>11}{'ratio':>7}{'CPU s/GB':>10}{'read GB/s':>11}{'ratio':>7}"
        f"{'CPU s/GB':>10}{'write() us':>12}{'read() us':>11}   per-round ratios w / r",
        f"{'raw O_DIRECT':<14}{base['write_gbps']:>11.2f}{1.0:>7.2f}{'':>10}{base['read_gbps']:>11.2f}"
        f"{1.0:>7.2f}",
    ]
    for name, e in report["engines"].items():
        d = report["_detail"][name]
        lines.append(f"{name:<14}{e['write_gbps']:>11.2f}{e['write_ratio']:>7.2f}{d['write_cpu_s_per_gb']:>10.3f}"
                     f"{e['read_gbps']:>11.2f}{e['read_ratio']:>7.2f}{d['read_cpu_s_per_gb']:>10.3f}"
                     f"{d['write_call_us']:>12.1f}{d['read_call_us']:>11.1f}   "
                     f"{d['write_ratio_range'][0]:.2f}-{d['write_ratio_range'][1]:.2f} / "
                     f"{d['read_ratio_range'][0]:.2f}-{d['read_ratio_range'][1]:.2f}")
    for name, why in report["_skipped"].items():
        lines.append(f"{name:<14}skipped: {why}")
    method = report["method"]
    lines += ["", f"Medians of {report['_rounds']} round(s). Each round, per engine: {method['segments_per_side']} "
              f"segments a side of up to {method['segment_mib']:g} MiB, in the order baseline, engine, engine, "
              "baseline (ABBA),",
              f"both into fresh preallocated space; baseline: {BASELINE_THREADS} threads x "
              f"{BASELINE_BLOCK // MiB} MiB O_DIRECT requests; the engine one step per segment after an "
              "untimed first step.",
              "ratio: the engine's GB/s over the baseline's, bytes and seconds summed per side over a round "
              "(median over rounds; range at the right).",
              "CPU s/GB, write() us, read() us: CPU time of the calling (training) thread; "
              "cpu_us_per_tensor is the larger of the two per-call figures."]
    if "memory" in report["engines"]:
        lines.append("memory: host RAM, no disk; its ratios only compare it with the drive.")
    for label, cost in report.get("verify_cost", {}).items():
        off = label.partition("+")[0]
        lines.append(f"{label} / {off}: GB/s write {cost['write_gbps_ratio']:.3f}, read "
                     f"{cost['read_gbps_ratio']:.3f}; GB per CPU-second of the process (all threads) "
                     f"write {cost['write_gb_per_core_s_ratio']:.3f}, read {cost['read_gb_per_core_s_ratio']:.3f}")
    if "layout" in report:
        lay = report["layout"]
        lines += ["", "layout (same threads and request size, no engine):",
                  f"  one slab:            write {lay['slab']['write_gbps']:.2f} GB/s, read "
                  f"{lay['slab']['read_gbps']:.2f} GB/s",
                  f"  one file per tensor: write {lay['file_per_tensor']['write_gbps']:.2f} GB/s, read "
                  f"{lay['file_per_tensor']['read_gbps']:.2f} GB/s, unlink "
                  f"{lay['file_per_tensor']['unlink_us_per_file']:.0f} us/file"]
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------


def add_io_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``io-bench`` on an ``add_subparsers()`` object; ``args.func(args)`` runs it."""
    p = subparsers.add_parser(
        "io-bench", help="measure the IO engines against the drive's raw O_DIRECT limit",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="directory on the drive to measure (a scratch "
                   "directory is created in it and removed afterwards)")
    p.add_argument("--engine", default="all", choices=ENGINE_CHOICES,
                   help="engine to measure; 'all' = posix, aio (skipped with the reason when it "
                        "cannot run here) and memory (default: all)")
    p.add_argument("--tensor-mib", type=positive_float, default=64.0, metavar="MIB",
                   help="tensor size in MiB (2^20 bytes; default 64)")
    p.add_argument("--total-gib", type=positive_float, default=4.0, metavar="GIB",
                   help="GiB (2^30 bytes) written and read back per engine and by the baseline "
                        "(default 4); speeds are reported in GB/s (10^9 bytes per second)")
    deprecated_alias(p, "--tensor-mb", "--tensor-mib", "tensor_mib", positive_float)
    deprecated_alias(p, "--total-gb", "--total-gib", "total_gib", positive_float)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--compare-layout", action="store_true",
                   help="also measure one slab file against one file per tensor")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="measure everything this many times and report medians (the drive's speed "
                        "drifts; default 3)")
    p.add_argument("--segment-mib", type=positive_float, default=SEGMENT_MIB, metavar="MIB",
                   help="within a round the baseline and each engine take turns in segments of about "
                        "this many MiB, in the order baseline, engine, engine, baseline (default "
                        f"{SEGMENT_MIB:g})")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an OffloadConfig field for the engines, e.g. --set io_threads=8 "
                        "(YAML value; repeatable)")
    p.add_argument("--verify", type=verify_methods, default=None, metavar="{off,crc32c}[,...]",
                   help="measure each engine with this verification (OffloadConfig.verify); "
                        "'off,crc32c' measures both side by side and reports the cost as ratios "
                        "(default: the --set value, else off)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run_io_bench)



@contextlib.contextmanager
def _stdout_to_stderr(enabled: bool):
    """While measuring, send what libraries print to stdout (DeepSpeed's logger; DeepNVMe's
    C++ messages on descriptor 1) to stderr, so that stdout holds the JSON object alone."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _config_from_sets(sets: List[str]) -> OffloadConfig:
    import yaml

    values = {}
    for item in sets:
        field, sep, value = item.partition("=")
        if not sep or field not in OffloadConfig.field_names():
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of "
                             + ", ".join(OffloadConfig.field_names()))
        values[field] = yaml.safe_load(value)
    return OffloadConfig(**values)


def run_io_bench(args: argparse.Namespace) -> int:
    try:
        base_config = _config_from_sets(args.set)
    except (ValueError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    directory = writable_dir("--dir", args.dir)
    engines = list(ALL_ENGINES) if args.engine == "all" else [args.engine]
    if args.engine != "all":  # before measuring anything: say at once what cannot run
        check_engine("--engine", args.engine)
    progress = Progress(enabled=not args.quiet)
    progress.say(f"{directory}: {args.rounds} round(s), {args.tensor_mib:g} MiB tensors, "
                 f"{args.total_gib:g} GiB per engine and baseline; engines {', '.join(engines)}; "
                 f"io_threads {base_config.io_threads}, chunk_bytes {base_config.chunk_bytes >> 20} MiB")
    try:
        with _stdout_to_stderr(args.json):
            report = run(directory, engines, args.tensor_mib, args.total_gib, progress,
                         args.compare_layout, args.rounds, base_config, args.verify, args.segment_mib)
    except BenchError as exc:
        raise EnvironmentProblem(str(exc)) from exc
    finally:
        progress.close()
    if args.engine != "all" and args.engine in report["_skipped"]:
        raise EnvironmentProblem(f"--engine {args.engine}: cannot run here: "
                                 f"{report['_skipped'][args.engine]}")
    if not report["engines"]:
        raise UsageError("nothing to measure: " + "; ".join(f"{k}: {v}" for k, v in report["_skipped"].items()))
    if args.json:
        print(json.dumps(public(report)))
    else:
        print(format_table(report))
    return 0
