"""`ssdtrain bench`'s measurement loop: every strategy at every micro-batch size, step by step.

Split out of ``cli.py`` (the command line, the figures and the table; it re-exports these
names) so that no module is longer than a few hundred lines. Progress goes to stderr.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Dict, List, Optional, Sequence, Tuple

from ...config import OffloadConfig
from ..cli_types import progress, say
from .background_load import BackgroundLoad
from .budget import adaptive_config, default_budget
from .compare import CONTROL

if TYPE_CHECKING:
    from ...telemetry.peak_memory import PeakMemory


@dataclass(frozen=True)
class Strategy:
    name: str
    policy: str
    """OffloadConfig.policy of the offloader installed for it."""
    recompute: Optional[str] = None
    """GPTSpec.recompute: megatron's activation recomputation."""
    verify: Optional[str] = None
    """OffloadConfig.verify of its offloader (None: the bench's config's)."""


STRATEGIES = (Strategy("keep", "keep"), Strategy("offload", "offload"),
              Strategy("adaptive", "adaptive"), Strategy("recompute", "keep", "full"))
CONTROL_RUN = Strategy(CONTROL, "keep")
"""A second keep run beside keep: the control of the loss comparison (compare.py)."""
VERIFIED = Strategy("offload+crc32c", "offload", verify="crc32c")
"""offload with every chunk checksummed and verified: ``--verify off,crc32c`` runs it beside
offload (verify off), so the cost of verification is a ratio of one run."""
HOST_ONLY = Strategy("host", "offload")
"""--node-emulation: the host tier alone (the memory engine; what does not fit stays in memory)."""
PLANNED = Strategy("planned", "offload")
"""--node-emulation: the four-place plan for the emulated node, as fixed per-layer decisions
on the tiered engine, within the budget (node.py ``PlannedTiers``)."""
NODE_STRATEGIES = STRATEGIES[:2] + (HOST_ONLY, PLANNED) + STRATEGIES[2:]
"""What --node-emulation runs by default."""
ALL_STRATEGIES = STRATEGIES[:1] + (CONTROL_RUN,) + STRATEGIES[1:2] + (VERIFIED, HOST_ONLY, PLANNED) + STRATEGIES[2:]
"""Every strategy the bench knows, in the order the report lists them."""
SAME_LOSSES = ("keep", "offload", "offload+crc32c", "host", "planned", "adaptive")
"""Strategies whose losses must be bitwise equal (recompute's are compared and reported)."""

@dataclass
class Point:
    """One (strategy, micro-batch) of the curve: what --json prints per point."""

    strategy: str
    micro_batch: int
    step_s: float
    tokens_per_s: float
    peak_activation_bytes: int
    peak_memory_bytes: Optional[int]
    step_s_min: float = 0.0
    step_s_max: float = 0.0


@dataclass
class _Series:
    """Everything measured for one (strategy, micro-batch), warm-up steps included."""

    losses: List[float] = field(default_factory=list)
    mb_losses: List[List[float]] = field(default_factory=list)
    """Per step, each micro-batch's loss (what compare.py compares bit for bit)."""
    times: List[float] = field(default_factory=list)
    activation: List[int] = field(default_factory=list)
    memory: List[Optional[int]] = field(default_factory=list)
    io_wait: List[float] = field(default_factory=list)
    budget_wait: List[float] = field(default_factory=list)
    """Seconds pack or a read waited for writes to stay within the budget, per step."""
    offloaded: List[int] = field(default_factory=list)
    read: List[int] = field(default_factory=list)
    """Bytes read back from the engine, per step (what crossed the drive on the way back)."""
    forwarded: List[int] = field(default_factory=list)
    """Tensors served from memory instead of read back (their write had not finished), per step."""
    fallbacks: List[int] = field(default_factory=list)
    """Writes that failed (a full disk) and stayed in memory, per step."""
    cpu: List[float] = field(default_factory=list)
    """Process CPU seconds (user + system, all threads) of each step: unlike the wall time,
    hardly touched by other processes on the machine; the IO threads' work shows here."""
    layer_bytes: int = 0
    """Largest one layer's saved activations of one micro-batch (the most a recompute pass
    re-creates at once)."""

    settle_steps: Optional[int] = None
    """adaptive: steps it ran alone before it settled (its exploration), not in ``times``."""
    explore_times: List[float] = field(default_factory=list)
    """adaptive: the step times of those steps."""
    explore_peak: int = 0
    """adaptive: the peak resident activation bytes over those steps (within the budget too)."""
    explore_log: List[str] = field(default_factory=list)
    """adaptive: what measured selection tried, measured and settled on (its log lines)."""
    unsettled: int = 0
    """adaptive: measured steps (after the warm-up) that ran while it explored again (drift)."""
    last_stats: Optional[object] = None
    """The StepStats of its last step (per-layer figures, the plan adaptive ran)."""
    plan_rows: Optional[tuple] = None
    """planned: the places it ran, per micro-batch position and layer."""

    PER_STEP: ClassVar[Tuple[str, ...]] = (
        "losses", "mb_losses", "times", "activation", "memory", "io_wait", "budget_wait", "offloaded",
        "read", "forwarded", "fallbacks", "cpu")
    """The lists with one entry per step, in ``add_step``'s order."""

    def add_step(self, loss: float, mb_losses: List[float], seconds: float, st, memory: Optional[int],
                 cpu_s: float, num_microbatches: int) -> None:
        """One step's figures, ``st`` its StepStats, into every per-step list."""
        for name, value in zip(self.PER_STEP, (
                loss, list(mb_losses), seconds, st.peak_resident_bytes, memory, st.io_wait_s,
                st.budget_wait_s, st.bytes_offloaded, st.bytes_read, st.tensors_forwarded,
                st.fallbacks, cpu_s)):
            getattr(self, name).append(value)
        self.last_stats = st
        layers = [r.bytes // num_microbatches for r in st.layers if r.layer != "None"]
        self.layer_bytes = max(layers + [self.layer_bytes])

    def take_last_step(self) -> Tuple[float, int]:
        """Remove the last step from every per-step list (adaptive's exploring steps are not
        measured steps); (its time, its peak resident activation bytes)."""
        last = {name: getattr(self, name).pop() for name in self.PER_STEP}
        return last["times"], last["activation"]

    def point(self, strategy: str, micro_batch: int, tokens: int, warmup: int) -> Point:
        times = self.times[warmup:]
        t = statistics.median(times)
        mem = [m for m in self.memory[warmup:] if m is not None]
        return Point(strategy, micro_batch, t, tokens / t, max(self.activation[warmup:]),
                     max(mem) if mem else None, min(times), max(times))


@dataclass
class BenchRun:
    """What measure() saw: the series per (strategy, micro-batch) and how the run went."""

    spec: object
    steps: int
    warmup: int
    device: str
    memory_kind: Optional[str]
    series: Dict[tuple, _Series] = field(default_factory=dict)
    out_of_memory: List[tuple] = field(default_factory=list)
    files_left: List[str] = field(default_factory=list)
    adaptive_budgets: Dict[int, Optional[int]] = field(default_factory=dict)
    """activation_budget_bytes adaptive ran with, per micro-batch size (None: keep everything)."""
    background_load: int = 0
    """Busy processes that competed for the CPU during every strategy's steps."""
    node: Optional[object] = None
    """--node-emulation: the emulated node (node.py ``NodeEmulation``)."""


def verify_ratios(run: BenchRun, at: dict, mb: Optional[int]) -> Dict[str, float]:
    """offload+crc32c against offload at micro-batch ``mb`` (step time, process CPU time),
    when both ran; ``at``: (strategy, micro-batch) -> Point."""
    a, b = at.get((VERIFIED.name, mb)), at.get(("offload", mb))
    if a is None or b is None:
        return {}
    cpu = [statistics.median(run.series[(n, mb)].cpu[run.warmup:]) for n in (VERIFIED.name, "offload")]
    return {f"{VERIFIED.name}_vs_offload_step_time": a.step_s / max(b.step_s, 1e-12),
            f"{VERIFIED.name}_vs_offload_cpu_time": cpu[0] / max(cpu[1], 1e-12)}


def measure(spec, cfg: OffloadConfig, micro_batches: Sequence[int], steps: int, warmup: int,
            strategies: Sequence[Strategy] = STRATEGIES, budget: Optional[int] = None,
            background_load: int = 0, node=None) -> BenchRun:
    """Train ``warmup + steps`` steps of every strategy at every micro-batch size, the strategies
    taking turns step by step; one model and one offloader per strategy and size. Adaptive
    first runs alone until its measured selection settles (bounded), then starts over on a
    fresh model beside the others, settled. A strategy that runs out of device memory at a size
    is not tried at larger ones. ``background_load`` busy processes run all along; ``node``
    (node.py): the emulated node the strategies run on."""
    from ..demo import header_lines
    from ..minigpt import MegatronRuntime
    from ...telemetry.peak_memory import PeakMemory

    with MegatronRuntime() as rt, BackgroundLoad(background_load):
        peak = PeakMemory(rt.device, trim=node is None)  # an emulated node keeps freed memory (node.py)
        run = BenchRun(spec, steps, warmup, str(rt.device), peak.kind, background_load=background_load,
                       node=node)
        print(f"ssdtrain bench: megatron-core GPT, {spec.layers} layers, hidden {spec.hidden}, "
              f"seq {spec.seq}, {spec.num_microbatches} micro-batches per step, on {rt.device}; "
              f"micro-batch sizes {', '.join(map(str, micro_batches))}; {warmup} warm-up + {steps} "
              f"measured steps per point"
              + (f"; {background_load} busy background process(es)" if background_load else ""),
              file=sys.stderr)
        for line in header_lines(cfg, cfg.dirs[0]):
            print("  " + line, file=sys.stderr)
        if node is not None:  # confine compute, measure what the plan needs (node.py)
            node.start(spec, cfg, rt.device, max(micro_batches))
            for line in node.describe():
                print("  " + line, file=sys.stderr)
        alive = list(strategies)
        bar = progress(len(micro_batches) * (warmup + steps), desc="bench", unit="round")
        try:
            keep_peaks: Dict[int, int] = {}
            for mb in micro_batches:
                run.adaptive_budgets[mb] = budget if budget is not None else \
                    default_budget(list(micro_batches), keep_peaks)
                _measure_size(run, mb, alive, spec, cfg, rt.device, peak, bar)
                alive = [s for s in alive if (s.name, mb) not in run.out_of_memory]
                if ("keep", mb) in run.series:
                    keep_peaks[mb] = max(run.series[("keep", mb)].activation[warmup:])
        finally:
            bar.close()
    return run


def _measure_size(run: BenchRun, mb: int, alive: List[Strategy], spec, cfg: OffloadConfig,
                  device, peak, bar) -> None:
    """Every strategy in ``alive`` at micro-batch size ``mb``, taking turns step by step."""
    budget = run.adaptive_budgets.get(mb)
    contenders = [_Contender(s, dataclasses.replace(spec, micro_batch=mb), _config(s, cfg, budget, run.node),
                             device) for s in alive]
    planned = [c for c in contenders if c.strategy is PLANNED]
    recompute = next((c for c in contenders if c.strategy.name == "recompute"), None)
    offload = next((c for c in contenders if c.strategy.name == "offload"), None)
    if planned:
        from .node import PlannedTiers

        planned[0].planned = PlannedTiers(run.node, budget, spec.layers, planned[0].offloader)
    try:
        for c in contenders:
            run.series[(c.strategy.name, mb)] = c.series
            if c.explores():
                _settle(c, peak, bar, mb)
        for i in range(run.warmup + run.steps):
            k = i % len(contenders)
            for c in contenders[k:] + contenders[:k]:  # nobody always goes first
                if c.explores() and i >= run.warmup and not c.offloader.planner.selection.settled:
                    c.series.unsettled += 1
                if not c.step(peak):
                    run.out_of_memory.append((c.strategy.name, mb))
                    run.series.pop((c.strategy.name, mb))
                    say(bar, f"micro-batch {mb}: {c.strategy.name} ran out of device memory")
            times = ", ".join(f"{c.strategy.name} {c.series.times[-1]:.2f}s"
                              for c in contenders[k:] + contenders[:k] if c.model is not None)
            say(bar, f"micro-batch {mb}, step {i + 1}/{run.warmup + run.steps}"
                     f"{' (warm-up)' if i < run.warmup else ''}: {times}")
            bar.update(1)
            if i < run.warmup:  # planned plans from keep's latest step, before the measured ones
                for c in planned:
                    c.plan_from(contenders[0], spec.num_microbatches, recompute, offload)
    finally:
        for c in contenders:
            run.files_left += c.close()
        del contenders
        gc.collect()


def _config(s: Strategy, cfg: OffloadConfig, budget: Optional[int], node) -> OffloadConfig:
    """Strategy ``s``'s settings: on the emulated node's tiers; adaptive (and planned) within
    the budget."""
    out = node.config(s.name, cfg) if node is not None else cfg
    if s.name in ("adaptive", "planned"):
        out = adaptive_config(out, budget)
    return out


def _settle(c: "_Contender", peak, bar, mb: int) -> None:
    """Adaptive alone until its measured selection settles (at most the bound its settings
    give, twice over for one drift), then a fresh model: its measured steps start where the
    others' do, so that the losses compare step by step."""
    from ..minigpt import MiniGPT

    sel = c.offloader.planner.selection
    cap = 1 + 2 * sel.bounds.round_steps
    series = c.series
    for n in range(1, cap + 1):
        if not c.step(peak):
            return
        seconds, activation = series.take_last_step()
        series.explore_times.append(seconds)
        series.explore_peak = max(series.explore_peak, activation)
        say(bar, f"micro-batch {mb}: adaptive exploring, step {n}: {series.explore_times[-1]:.2f}s")
        if sel.settled:
            series.settle_steps = n
            break
    else:
        say(bar, f"micro-batch {mb}: adaptive did not settle within {cap} steps")
    series.explore_log = list(sel.history)
    for line in sel.history:  # the planner logs these at INFO; the bench shows them anyway
        say(bar, f"micro-batch {mb}: adaptive {line}")
    c.model = MiniGPT(c.spec, c.device)
    sel.rebaseline()  # the others' models now run beside it: not a drift of the machine


class _Contender:
    """One strategy at one micro-batch size: its model, its offloader and what they measured."""

    def __init__(self, strategy: Strategy, spec, cfg: OffloadConfig, device) -> None:
        from ...cache import ActivationOffloader
        from ..minigpt import MiniGPT

        self.strategy = strategy
        self.device = device
        self.spec = dataclasses.replace(spec, recompute=strategy.recompute)
        self.model: Optional[MiniGPT] = MiniGPT(self.spec, device)
        # A job name per strategy: each offloader gets its own directory in the root.
        changes = {"verify": strategy.verify} if strategy.verify else {}
        job = f"bench-{strategy.name.replace('+', '-')}"
        self.offloader = ActivationOffloader(cfg.replace(policy=strategy.policy, job=job, **changes),
                                             device=device)
        self.series = _Series()
        self.planned = None
        """planned: its PlannedTiers (node.py)."""

    def plan_from(self, keep: "_Contender", num_micro_batches: int,
                  recompute: Optional["_Contender"] = None, offload: Optional["_Contender"] = None) -> None:
        """planned: (re)plan from the keep contender's last step, recomputing a layer priced
        at the pass the recompute contender's last step measured for it (as the prediction
        prices it; predict.py), each layer's bytes what the offload contender's last
        step moved of it."""
        if self.planned is not None and keep.series.last_stats is not None:
            recomputed = recompute.series.last_stats if recompute is not None else None
            moved = offload.series.last_stats if offload is not None else None
            self.planned.plan_from(self.offloader, keep.series.last_stats, num_micro_batches, recomputed, moved)
            if self.planned.plan is not None:
                self.series.plan_rows = self.planned.plan.decisions

    def explores(self) -> bool:
        """Adaptive under a budget with measured selection on: it has something to settle."""
        p = self.offloader.planner
        return p is not None and p.selection is not None and p.has_budget

    def step(self, peak: PeakMemory) -> bool:
        """One measured step; False when it ran out of device memory (the model is dropped)."""
        import torch

        from ..minigpt import installed_step

        if self.model is None:
            return True
        peak.reset()
        cpu0 = os.times()
        try:
            loss, dt = installed_step(self.model, self.offloader)
        except torch.cuda.OutOfMemoryError:
            self.model = None
            self.offloader.close()
            torch.cuda.empty_cache()
            return False
        cpu1 = os.times()
        self.series.add_step(loss, self.model.last_losses, dt, self.offloader.last_step_stats, peak.peak(),
                             cpu1.user - cpu0.user + cpu1.system - cpu0.system, self.spec.num_microbatches)
        return True

    def close(self) -> List[str]:
        """Close the offloader; the files it left behind (none, unless something leaked)."""
        dirs = self.offloader.rank_dirs
        self.offloader.close()
        self.model = None
        return [os.path.join(d, f) for d in dirs if os.path.isdir(d) for f in os.listdir(d)]
