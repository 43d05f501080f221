"""Remove this process's offload directories on normal exit and on SIGINT/SIGTERM.

The registry of live directories is the one piece of process-wide state the IO layer keeps:
a signal handler has nothing else to reach them through.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from typing import Callable, Dict

log = logging.getLogger(__name__)

_lock = threading.RLock()  # re-entrant: a signal may arrive while this thread holds it
_cleaners: Dict[int, Callable[[], None]] = {}
_installed = False
_previous: Dict[int, object] = {}


def register(token: int, cleaner: Callable[[], None]) -> None:
    """Run ``cleaner`` at exit or on SIGINT/SIGTERM unless ``unregister(token)`` came first."""
    global _installed
    with _lock:
        _cleaners[token] = cleaner
        if not _installed:
            atexit.register(_run_all)
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    _previous[sig] = signal.getsignal(sig)
                    signal.signal(sig, _on_signal)
            _installed = True


def unregister(token: int) -> None:
    with _lock:
        _cleaners.pop(token, None)


def _run_all() -> None:
    with _lock:
        cleaners = list(_cleaners.values())
        _cleaners.clear()
    for clean in cleaners:
        try:
            clean()
        except Exception as exc:  # keep cleaning the other directories, but say so
            log.error("ssdtrain: cleanup failed: %s", exc)


def _on_signal(signum, frame) -> None:
    _run_all()
    prev = _previous.get(signum)
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_IGN:
        return
    else:  # default action: die of the same signal, as the user expects
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
