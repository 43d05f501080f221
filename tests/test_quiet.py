"""Long commands stay readable (tools/quiet.py): each kind of warning once, repeats counted and
said in one line; ``ssdtrain soak`` prints at most 10 lines before its summary."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import warnings

import pytest

from ssdtrain_megatron.tools.quiet import WarningTally, kind_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_kind_is_the_first_sentence_without_its_numbers():
    assert kind_of("Transformer Engine and Apex are not installed. Falling back to X") == \
        kind_of("Transformer  Engine and Apex are not installed.\nFalling back to Y")
    assert kind_of("write at offset 749568 failed: No space left on device") == \
        kind_of("write at offset 319488 failed: No space left on device")
    assert kind_of("write at offset 1 failed: Input/output error") != \
        kind_of("write at offset 1 failed: No space left on device")


def _warn_and_log(log: logging.Logger) -> None:
    for module in ("optimizer", "clip_grads", "fsdp"):
        warnings.warn_explicit(f"Transformer Engine and Apex are not installed. Falling back in "
                               f"{module}.", UserWarning, f"{module}.py", 10)
    for offset in (4096, 8192):
        log.warning("ssdtrain: write at offset %d failed: Input/output error", offset)
    log.warning("ssdtrain: write at offset 1 failed: No space left on device")
    log.error("ssdtrain: rank 0 stopped")
    log.error("ssdtrain: rank 0 stopped")  # errors are never held back


def test_python_warnings_and_log_records_show_once_per_kind_and_the_rest_are_counted():
    """Broken variant (WarningTally.first always True): every warning shows; "At index 1 diff:
    'UserWarning (clip_grads.py:10): ...' != 'ssdtrain demo: 3 repeated warnings ...'"."""
    stream, log_stream = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(log_stream)
    log = logging.getLogger("ssdtrain_megatron.test_quiet")
    log.addHandler(handler)
    log.propagate = False
    shown_warnings = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            # Whoever shows warnings here (Python, on stderr; pytest's recorder): a recorder.
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
                shown_warnings.append(warnings.formatwarning(message, category, filename, lineno, line))
            with WarningTally([handler], "ssdtrain demo", stream=stream):
                _warn_and_log(log)
        shown = stream.getvalue().splitlines()
    finally:
        log.removeHandler(handler)
        log.propagate = True
    assert shown_warnings == ["optimizer.py:10: UserWarning: Transformer Engine and Apex are not "
                              "installed. Falling back in optimizer.\n"]  # one line: no source
    assert shown == [
        "ssdtrain demo: 3 repeated warnings not shown: 2 x 'Transformer Engine and Apex are not "
        "installed.', 1 x 'ssdtrain: write at offset # failed: Input/output error'"]
    assert log_stream.getvalue().splitlines() == [
        "ssdtrain: write at offset 4096 failed: Input/output error",
        "ssdtrain: write at offset 1 failed: No space left on device",
        "ssdtrain: rank 0 stopped", "ssdtrain: rank 0 stopped"]
    assert handler.filters == []  # taken off again


def _soak(*flags: str) -> list:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "ssdtrain_megatron.tools", "soak", *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    lines = out.stdout.splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("ssdtrain soak: ")
                   and " steps, seed " in line)
    return lines[:summary]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_short_soak_at_a_high_fault_rate_says_each_kind_of_warning_once():
    """4 steps at 15 times the default fault rate. Broken variant (cli.py without the
    WarningTally): megatron-core's import warnings alone are 14 lines (seven, of two lines
    each) and `len(before) <= 10` fails."""
    pytest.importorskip("megatron.core")
    before = _soak("--steps", "4", "--faults", "all", "--seed", "1", "--rate", "0.03",
                   "--stall-rate", "0")
    assert len(before) <= 10, "\n".join(before)
    kinds = [kind_of(line.split(": ", 1)[-1]) for line in before]
    assert len(kinds) == len(set(kinds)), "\n".join(before)


@pytest.mark.slow
def test_the_soak_of_the_issue_prints_at_most_10_lines_before_its_summary():
    """The command of issue 36: `ssdtrain soak --steps 50 --faults all` (a minute or two)."""
    pytest.importorskip("megatron.core")
    before = _soak("--steps", "50", "--faults", "all")
    assert len(before) <= 10, "\n".join(before)
