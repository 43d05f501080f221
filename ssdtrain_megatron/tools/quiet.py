"""Long commands stay readable: each kind of warning is shown once, its repeats counted.

``ssdtrain soak`` used to print some thirty warning lines before its summary: megatron-core
says "Transformer Engine and Apex are not installed" from six modules as it is imported (each
a two-line Python warning), and every offloader a soak restarts after a loud failure warns
again about its fallbacks and retries. :class:`WarningTally`, around every ``ssdtrain``
subcommand (cli.py), shows the first warning of each kind in one line and counts the rest; a
command that ends with a summary asks for :meth:`WarningTally.summary_line` just before it,
and what is still counted at the end is said in one line then.

A kind is the warning's first sentence with its numbers taken out, per category (Python
warnings) or per logger (WARNING records): ``write of 20480 bytes ... at offset 749568 failed:
No space left on device`` and the same at another offset are one kind, the same write failing
with ``Input/output error`` another. Errors are never held back, nor anything below WARNING.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import Dict, List, Optional, Sequence, TextIO, Tuple

SHOWN_KINDS = 3
"""Kinds named in the summary line (the rest are counted)."""


def kind_of(text: str) -> str:
    """The first sentence of ``text``, whitespace made single spaces, numbers made ``#``."""
    flat = " ".join(str(text).split())
    first = re.split(r"(?<=[.!?])\s", flat, maxsplit=1)[0]
    return re.sub(r"\d+", "#", first)


class _RepeatFilter(logging.Filter):
    def __init__(self, tally: "WarningTally") -> None:
        super().__init__()
        self.tally = tally

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        return self.tally.first((record.name, kind_of(record.getMessage())))


class WarningTally:
    """Shows the first warning of each kind, counts the repeats (module docstring).

    Args:
        handlers: the log handlers to filter (those the command set up; others are left alone).
        prefix: what the summary line starts with (``ssdtrain soak``).
        stream: where the summary line goes (default: stderr); Python warnings are shown
            where they were before (the first of each kind).
    """

    def __init__(self, handlers: Sequence[logging.Handler], prefix: str,
                 stream: Optional[TextIO] = None) -> None:
        self.handlers = list(handlers)
        self.prefix = prefix
        self.stream = stream
        self.repeats: Dict[Tuple[str, str], int] = {}
        self._seen: set = set()
        self._filter = _RepeatFilter(self)
        self._catch: Optional[warnings.catch_warnings] = None
        self._previous = warnings.showwarning

    def first(self, kind: Tuple[str, str]) -> bool:
        """True the first time ``kind`` is seen; later, count it and return False."""
        if kind not in self._seen:
            self._seen.add(kind)
            return True
        self.repeats[kind] = self.repeats.get(kind, 0) + 1
        return False

    def _show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        # The first of a kind is shown as it would have been (by whoever shows warnings here:
        # Python on stderr, a test's recorder), without its source line: one line.
        if self.first((category.__name__, kind_of(message))):
            self._previous(message, category, filename, lineno, file, "")

    def summary_line(self) -> str:
        """One line saying how many repeats were held back, of which kinds; '' when none.
        The counts start again from zero."""
        if not self.repeats:
            return ""
        total = sum(self.repeats.values())
        ranked: List[Tuple[Tuple[str, str], int]] = sorted(self.repeats.items(), key=lambda kv: -kv[1])
        named = ", ".join(f"{n} x {kind[1]!r}" for kind, n in ranked[:SHOWN_KINDS])
        others = len(ranked) - SHOWN_KINDS
        self.repeats = {}
        return (f"{self.prefix}: {total} repeated warning{'s' if total != 1 else ''} not shown: "
                f"{named}" + (f" and {others} more kind{'s' if others != 1 else ''}" if others > 0 else ""))

    def __enter__(self) -> "WarningTally":
        self._catch = warnings.catch_warnings()  # restores showwarning (and the filters) at exit
        self._catch.__enter__()
        self._previous = warnings.showwarning
        warnings.showwarning = self._show_warning
        for handler in self.handlers:
            handler.addFilter(self._filter)
        return self

    def __exit__(self, *exc) -> None:
        for handler in self.handlers:
            handler.removeFilter(self._filter)
        if self._catch is not None:
            self._catch.__exit__(*exc)
            self._catch = None
        line = self.summary_line()
        if line:
            print(line, file=self.stream or sys.stderr)
