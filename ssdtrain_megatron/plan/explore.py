"""Measured selection: the adaptive planner's model is the prior, measured step times decide.

Pure (no torch, no IO, no clock): the adaptive loop (cache/adaptive.py) reports each finished
step's time and the plan it ran; :class:`MeasuredSelection` answers which plan the next step
runs. A plan is opaque here (anything hashable: the planner uses decisions[position][layer]).

How it moves, in rounds:

* prior: the model's plan runs ``trial_steps`` steps; it is the incumbent.
* explore: candidates (neighbouring plans, and whole-plan ones such as all-recompute, that the
  planner offers and has checked against the memory budget) run ``trial_steps`` steps each, at
  most ``explore_steps`` steps in the round, each candidate step followed by a step of the
  incumbent: the pair saw the same machine. A candidate replaces the incumbent only when the
  median of its pairs' ratios (candidate step over the incumbent step after it) is below 1 by
  more than the noise (``min_gain``, or the ratios' spread: their median absolute deviation
  over their median, whichever is larger) and every pair was faster; the candidates are then
  offered anew around it. Three pairs of which one was slower are what noise looks like here:
  the node emulation's adaptive once took a plan "faster by 2.7%" on two pairs of three,
  which the model priced slower and which ran 2.6% slower than the model's plan.
  Why pairs: the machines this runs on change speed by up to 2x within minutes, so a candidate
  measured minutes after the incumbent's last steps is compared with another machine; a step
  beside it is not (docs/benchmarks.md measures every strategy the same way).
* settled: the incumbent runs, and nothing else. When the median of its last ``trial_steps``
  step times moves by more than ``drift`` (relative) from the median it settled on, a new
  round starts, bounded like the first (its incumbent measured again, not remembered).

The bound is on steps, so the cost of exploring is known up front: at most ``explore_steps``
steps per round run a plan other than the incumbent, and as many run the incumbent beside them:
a round lasts at most ``trial_steps + 2 * explore_steps`` steps.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

Candidates = Callable[[Hashable], Sequence[Tuple[str, Hashable]]]
"""Given the incumbent plan, (label, plan) pairs to try, best guess first (budget-checked)."""

PRIOR, EXPLORE, SETTLED = "prior", "explore", "settled"


@dataclass
class Trial:
    """One plan's measurements in the current round."""

    label: str
    times: List[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def noise(self) -> float:
        """Median absolute deviation over the median: one outlier of three does not count."""
        med = self.median
        return statistics.median(abs(t - med) for t in self.times) / med if med > 0 else 0.0

    def describe(self) -> str:
        return (f"{self.label}: median {self.median:.3f}s (min {min(self.times):.3f}, max "
                f"{max(self.times):.3f}, {len(self.times)} steps)")


@dataclass(frozen=True)
class Bounds:
    """How much measuring the selection may do; see the module docstring."""

    trial_steps: int = 3
    explore_steps: int = 24
    min_gain: float = 0.02
    drift: float = 0.15

    def __post_init__(self) -> None:
        if not (isinstance(self.trial_steps, int) and self.trial_steps >= 1):
            raise ValueError(f"trial_steps={self.trial_steps!r} is invalid: expected an integer >= 1")
        if not (isinstance(self.explore_steps, int) and self.explore_steps >= 0):
            raise ValueError(f"explore_steps={self.explore_steps!r} is invalid: expected an integer >= 0")
        for name in ("min_gain", "drift"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected a number in [0, 1)")

    @property
    def round_steps(self) -> int:
        """The most steps one round takes: the prior's, and each explored step with the
        incumbent's step beside it."""
        return self.trial_steps + 2 * self.explore_steps

    def describe(self) -> str:
        return (f"the model's plan for {self.trial_steps} steps, then at most {self.explore_steps} "
                f"steps on other plans ({self.trial_steps} steps each, each followed by a step of the "
                f"best so far, kept only when faster than it by more than max({self.min_gain:.0%}, "
                "the measured spread)); none after settling unless "
                f"the step time drifts by more than {self.drift:.0%}, which starts a re-exploration "
                "with the same bound")


class MeasuredSelection:
    """Which plan the next step runs, from the step times measured so far."""

    def __init__(self, bounds: Bounds, candidates: Candidates) -> None:
        self.bounds = bounds
        self._candidates = candidates
        self.phase = PRIOR
        self.incumbent: Optional[Hashable] = None
        self.current: Optional[Hashable] = None
        self._trials: Dict[Hashable, Trial] = {}
        self._explored = 0  # steps of this round spent on plans other than the incumbent
        self._candidate: Optional[Hashable] = None  # the plan being measured beside the incumbent
        self._beside: List[float] = []  # the incumbent's steps, each right after one of the candidate's
        self._settled_s = 0.0
        self._since_settled: List[float] = []
        self.steps = 0
        """Steps seen (the planner counts the ones that made a model plan too)."""
        self.settled_step: Optional[int] = None
        """Steps observed when it last settled (None: not settled yet)."""
        self.rounds = 0
        self.history: List[str] = []
        """One line per finished trial and per settling, as logged."""

    @property
    def settled(self) -> bool:
        return self.phase == SETTLED

    def start(self, label: str, plan: Hashable) -> None:
        """A new prior (the model's plan): measure it, then explore around it."""
        self.phase, self.incumbent, self.current = PRIOR, plan, plan
        self._trials = {plan: Trial(label)}
        self._explored = 0
        self.settled_step = None
        self.rounds += 1

    def observe(self, step_s: float) -> Hashable:
        """The step that ran ``self.current`` took ``step_s``; the plan for the next step."""
        self.steps += 1
        if self.current is None:
            raise RuntimeError("MeasuredSelection.observe() before start()")
        if self.phase == SETTLED:
            return self._watch(step_s)
        self._trials[self.current].times.append(step_s)
        if self.phase == PRIOR:
            if len(self._trials[self.current].times) < self.bounds.trial_steps:
                return self.current
            self.phase = EXPLORE
            return self._next()
        if self.current != self.incumbent:  # a candidate's step: the incumbent's runs beside it
            self.current = self.incumbent
            return self.current
        self._beside.append(step_s)
        trial = self._trials[self._candidate]
        if len(trial.times) < self.bounds.trial_steps:
            self.current = self._candidate
            return self.current
        self._judge(self._candidate)
        return self._next()

    def _judge(self, candidate: Hashable) -> None:
        """Each of the candidate's steps over the incumbent's step after it (module docstring)."""
        trial = self._trials[candidate]
        ref = Trial(self._trials[self.incumbent].label, list(self._beside))
        ratios = [c / i for c, i in zip(trial.times, ref.times) if i > 0]
        ratio = statistics.median(ratios) if ratios else 1.0
        noise = statistics.median(abs(r - ratio) for r in ratios) / ratio if ratios and ratio > 0 else 0.0
        needed = max(self.bounds.min_gain, noise)
        gain = 1.0 - ratio
        better = gain > needed and max(ratios) < 1.0
        slower = sum(r >= 1.0 for r in ratios)
        line = (f"tried {trial.describe()} against {ref.describe()} beside it: "
                f"{'faster' if gain > 0 else 'slower'} by {abs(gain):.1%} (median of {len(ratios)} "
                f"paired steps), needed {needed:.1%}"
                + (f" and every pair faster ({slower} not)" if gain > needed and slower else "")
                + ": " + ("now the incumbent" if better else "rejected"))
        self.history.append(line)
        log.info("ssdtrain adaptive: %s", line)
        if better:
            self.incumbent = candidate

    def _next(self) -> Hashable:
        """The next candidate to measure beside the incumbent, or settle (the bound, or none left)."""
        if self._explored + self.bounds.trial_steps <= self.bounds.explore_steps:
            for label, plan in self._candidates(self.incumbent):
                if plan not in self._trials:
                    self._trials[plan] = Trial(label)
                    self._explored += self.bounds.trial_steps
                    self.current = self._candidate = plan
                    self._beside = []
                    return plan
        return self._settle()

    def _settle(self) -> Hashable:
        self.phase, self.current, self._candidate = SETTLED, self.incumbent, None
        inc = self._trials[self.incumbent]
        self._settled_s = statistics.median(inc.times[-self.bounds.trial_steps:])
        self._since_settled = []
        self.settled_step = self.steps
        others = [t.describe() for p, t in self._trials.items() if p != self.incumbent and t.times]
        line = (f"settled after {self.steps} steps (round {self.rounds}, {self._explored} exploring) "
                f"on {inc.describe()}; other plans measured: " + ("; ".join(others) or "none"))
        self.history.append(line)
        log.info("ssdtrain adaptive: %s", line)
        return self.incumbent

    def rebaseline(self) -> None:
        """The surroundings changed on purpose (the bench puts the other strategies' models
        beside it): once settled, the next ``trial_steps`` step times are the new reference
        for drift, instead of drift themselves."""
        self._settled_s = 0.0
        self._since_settled = []

    def _watch(self, step_s: float) -> Hashable:
        recent = self._since_settled
        recent.append(step_s)
        del recent[:-self.bounds.trial_steps]
        if len(recent) == self.bounds.trial_steps and self._settled_s <= 0:
            self._settled_s = statistics.median(recent)  # after rebaseline()
        elif len(recent) == self.bounds.trial_steps:
            moved = statistics.median(recent) / self._settled_s - 1.0
            if abs(moved) > self.bounds.drift:
                line = (f"step time drifted by {moved:+.1%} (median of the last {len(recent)} "
                        f"{statistics.median(recent):.3f}s, settled on {self._settled_s:.3f}s): "
                        f"re-exploring, at most {self.bounds.explore_steps} steps")
                self.history.append(line)
                log.info("ssdtrain adaptive: %s", line)
                label = self._trials[self.incumbent].label
                self._trials = {self.incumbent: Trial(label, list(recent))}
                self._explored = 0
                self.rounds += 1
                self.phase = EXPLORE
                return self._next()
        return self.current
