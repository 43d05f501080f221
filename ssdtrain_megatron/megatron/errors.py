"""Our error, found in a thousand-rank log: one ERROR line per rank before the traceback.

An error raised inside Megatron's training loop by the offloader (a root that vanished, an IO
timeout, a read that failed past its retries, a full disk past its fallback) ends the worker
with a traceback of forty lines, interleaved with every other rank's, and then torchrun's own
report. :func:`report_error`, called where the launcher (and ``with_ssd_offload``) see the
exception leave the training script, logs its message first, in one line at ERROR level that
names the rank and the node, so that ``grep 'ssdtrain: rank'`` finds it; the exception then goes
on unchanged and Python prints its traceback, for debugging.

"Ours" is an exception whose class is defined in this package, or one raised by a frame of
it (an ``OSError`` from a system call our engine made), found along the exception's cause and
context chain (Megatron or autograd may have wrapped it). Anything else (a CUDA error, a
KeyboardInterrupt, Megatron's own ``SystemExit``) is left to its own report.
"""

from __future__ import annotations

import logging
import os
import socket
from types import TracebackType
from typing import Optional

log = logging.getLogger(__name__)

PACKAGE = __name__.split(".")[0]
_REPORTED = "_ssdtrain_reported"


def ours(exc: BaseException) -> Optional[BaseException]:
    """The first exception in ``exc``'s cause/context chain (as its traceback prints it) that
    comes from this package (module docstring), or None; None for an exit or an interrupt
    (SystemExit, KeyboardInterrupt: not errors, whatever they were raised after)."""
    if not isinstance(exc, Exception):
        return None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _defined_here(exc) or _raised_here(exc.__traceback__):
            return exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return None


def _defined_here(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] == PACKAGE


def _raised_here(tb: Optional[TracebackType]) -> bool:
    """Whether the innermost frame of ``tb`` runs this package's code."""
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__", "").split(".")[0] == PACKAGE


def one_line(exc: BaseException) -> str:
    """``ExceptionType: message``, the message's whitespace (newlines too) made single spaces."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def report_error(exc: BaseException, rank: Optional[int] = None) -> bool:
    """Log the one line of our error in ``exc`` at ERROR level, once per exception; True when
    this call logged it. ``rank``: the global rank (default: the RANK environment variable)."""
    found = ours(exc)
    if found is None or getattr(exc, _REPORTED, False):
        return False
    try:
        setattr(exc, _REPORTED, True)  # an outer wrapper (launcher and patch) logs nothing more
    except AttributeError:  # pragma: no cover - exceptions take attributes
        pass
    rank = rank if rank is not None else os.environ.get("RANK", "0")
    log.error("ssdtrain: rank %s on node %s stopped: %s (traceback below)", rank,
              socket.gethostname(), one_line(found))
    return True
