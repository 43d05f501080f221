"""One story per plan (issue 66, item 2): what a rendered ``ssdtrain plan`` must not contradict
in itself. :func:`contradictions` reads the text as a user would and lists every line that
disagrees with the first (fit, the job's batch and micro-batch), with the plan's own places
(the largest micro-batch) or with its own bandwidth figures (what binds)."""

from __future__ import annotations

import re
from typing import List

ROW = 29
"""Width of the row names (report.py pads them to 28 and a space)."""


def _row(lines: List[str], name: str) -> str:
    found = [line[ROW:] for line in lines if line.startswith(name)]
    return found[0] if found else ""


def contradictions(text: str) -> List[str]:
    """The contradictions in one plan's text (empty: one story)."""
    lines = text.splitlines()
    first, bad = lines[0], []
    fits = first.startswith("fits: ")
    if not fits and not first.startswith("DOES NOT FIT as planned: "):
        bad.append(f"first line answers no fit: {first[:80]}")
    later = "\n".join(lines[1:])
    unfit_later = [w for w in ("DOES NOT FIT", "EXCEED THE GPU'S MEMORY", "NOT RUNNABLE ON THE NODE")
                   if w in later]
    if fits and unfit_later:
        bad.append(f"first line fits, a later line says {unfit_later}")
    if not fits and not unfit_later:
        bad.append("first line does not fit, no later line says why")
    b = int(re.search(r", b=(\d+),", lines[1]).group(1))
    if not re.search(rf"a global batch of \d+ x \d+ tokens.*, micro-batch {b} \(", first):
        bad.append(f"first line names no global batch and micro-batch {b}: {first[-200:]}")
    largest = re.search(r"this plan (\d+),", _row(lines, "largest micro-batch"))
    if largest and fits != (int(largest.group(1)) >= b):
        bad.append(f"micro-batch {b} {'fits' if fits else 'does not fit'} as planned, but the "
                   f"largest this plan reaches is {largest.group(1)}")
    budgets = {re.search(r"of a ([\d.,]+) GB budget", _row(lines, "peak activations")).group(1),
               re.match(r"([\d.,]+) GB", _row(lines, "activation budget")).group(1)}
    largest_in = re.search(r"largest micro-batch in ([\d.,]+) GB", text).group(1)
    # the rows print one decimal, the largest micro-batch's row three significant digits
    if len(budgets) > 1 or abs(float(largest_in) - float(next(iter(budgets)).replace(",", ""))) \
            > 0.006 * float(largest_in) + 0.05:
        bad.append(f"budgets differ: peak and activation budget rows {budgets}, largest micro-batch "
                   f"in {largest_in} GB")
    binding = _row(lines, "binding")
    for name, row in (("the host link", "host link, each way"), ("the drives", "drives")):
        if not binding.startswith(name):
            continue
        m = re.match(r"\s*([\d.]+) GB/s used, ([\d.]+) needed, of ([\d.]+)", _row(lines, row))
        needed, available = float(m.group(2)), float(m.group(3))
        over = needed > available
        if over and "more than its" not in binding:
            bad.append(f"binding {name}: needed {needed} over {available}, not said")
        if not over and "serial" not in binding and "one layer more" not in binding:
            bad.append(f"binding {name} with {needed} of {available} GB/s needed and no reason")
    return bad
