"""Remove this process's offload directories on normal exit and on the signals that end a job.

The registry of cleaners is the one piece of process-wide state the IO layer keeps: a signal
handler has nothing else to reach them through. Its rules:

- It owns only what cleanup needs. A bound method is held weakly (an offloader that was
  dropped without ``close()`` is collected as usual; the engine under it registered its own
  cleaner). ``keep_alive=True`` holds the cleaner strongly: the disk engines use it for their
  ``remove_files``, because the exit path must stop their IO threads and remove their files
  even when nothing else references the engine.
- The atexit hook and the SIGINT/SIGTERM handlers are installed with the first cleaner and
  put back (the handlers that were there before) when the last cleaner is unregistered, e.g.
  when the last offloader closes. Handlers can only be changed on the main thread: an
  unregister elsewhere leaves ours in place, and they forward to the previous ones.
- A signal that lands while a ``__del__`` runs is forwarded once that ``__del__`` is over:
  the KeyboardInterrupt of the previous handler could not leave it (``_inside_del``).
- Preemption (``_on_signal``): a signal is first given to the Python handler that was there
  before ours. If it returns, the job goes on (Megatron's ``--exit-signal-handler`` only notes
  the signal, finishes the iteration, saves a checkpoint and exits; PyTorch Lightning's also
  only note it): the offloader keeps working, its files go at exit, at
  ``uninstall()`` or when the launcher's training run ends. If it raises (KeyboardInterrupt,
  SystemExit), the files are removed before the exception unwinds the job. With no Python
  handler (the default action), they are removed and the process dies of the signal; an
  ignored signal stays ignored. A process killed outright (SIGKILL after the grace period,
  ``os._exit`` in a handler) leaves its files to the next start's sweep or ``ssdtrain clean``.
- Fork: a cleaner runs only in the process that registered it. A forked child (a DataLoader
  worker, a ``multiprocessing`` fork-context process, a bare ``os.fork()``) inherits the
  registry, the atexit hook and our handlers, and would otherwise remove its parent's running
  job's files when it exits or when ``terminate()`` sends it SIGTERM. The registry is emptied in
  the child (``os.register_at_fork``) and every cleaner also carries the pid that registered it
  (a fork that bypasses the hooks, from C, is covered too); in a child our handlers only pass
  the signal on, as if they were not there.
"""

from __future__ import annotations

import _thread
import atexit
import inspect
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Callable, Dict, Hashable, Optional, Tuple

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""What a job is ended or preempted with: Ctrl-C, scancel and Slurm's time limit (SIGTERM), and
the signals that ``#SBATCH --signal`` or Megatron's ``--exit-signal`` may name instead."""

_lock = threading.RLock()  # re-entrant: a signal may arrive while this thread holds it
_cleaners: Dict[Hashable, Tuple[int, Callable[[], Optional[Callable[[], None]]]]] = {}
"""token -> (the pid that registered it, the getter of its cleaner)"""
_atexit_registered = False
_previous: Dict[int, object] = {}  # signal -> the handler ours replaced (ours installed iff set)


def register(token: Hashable, cleaner: Callable[[], None], keep_alive: bool = False) -> None:
    """Run ``cleaner`` at exit or on SIGINT/SIGTERM unless ``unregister(token)`` came first.

    A bound method is held weakly unless ``keep_alive``: when its object is gone, nothing
    runs. Any other callable is held as is (give it only what it needs to clean)."""
    if inspect.ismethod(cleaner) and not keep_alive:
        getter: Callable[[], Optional[Callable[[], None]]] = weakref.WeakMethod(cleaner)
    else:
        def getter(cleaner=cleaner):
            return cleaner
    with _lock:
        _prune()
        _cleaners[token] = (os.getpid(), getter)
        _install()


def unregister(token: Hashable) -> None:
    """Forget ``token``'s cleaner; with the last one gone, put the previous handlers back."""
    with _lock:
        _cleaners.pop(token, None)
        _prune()
        if not _cleaners:
            _uninstall()


def registered() -> int:
    """How many live cleaners there are (for tests and diagnostics)."""
    with _lock:
        _prune()
        return len(_cleaners)


def _prune() -> None:
    pid = os.getpid()
    for token in [t for t, (owner, get) in _cleaners.items() if owner != pid or get() is None]:
        del _cleaners[token]


def _forget_in_child() -> None:
    """After ``fork``, in the child: the parent's cleaners are not ours to run. A fresh lock:
    another thread of the parent may have held it at the fork, and is not in the child."""
    global _lock
    _lock = threading.RLock()
    _cleaners.clear()
    _deferred.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _install() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_run_all)
        _atexit_registered = True
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            if sig not in _previous:
                _previous[sig] = signal.getsignal(sig)
                signal.signal(sig, _on_signal)


def _uninstall() -> None:
    global _atexit_registered
    if _atexit_registered:
        atexit.unregister(_run_all)
        _atexit_registered = False
    if not _previous or threading.current_thread() is not threading.main_thread():
        return
    for sig, prev in list(_previous.items()):
        # Put back only what we replaced, and only if nobody replaced ours since; a handler
        # set outside Python (getsignal gave None) cannot be put back: ours stays, forwarding.
        if prev is not None and signal.getsignal(sig) is _on_signal:
            signal.signal(sig, prev)
            del _previous[sig]
        elif signal.getsignal(sig) is not _on_signal:
            del _previous[sig]


def _run_all() -> None:
    pid = os.getpid()
    with _lock:
        cleaners = [get() for owner, get in _cleaners.values() if owner == pid]
        _cleaners.clear()
    for clean in cleaners:
        if clean is None:
            continue
        try:
            clean()
        except Exception as exc:  # keep cleaning the other directories, but say so
            log.error("ssdtrain: cleanup failed: %s", exc)


interrupted: Optional[int] = None
"""While the cleaners run for a signal: that signal (else None). An object closed by them keeps
it and raises KeyboardInterrupt when used again after a SIGINT, not "closed"
(raise_if_interrupted): the backstop for an interrupt that Python dropped anyway (one raised
inside a weakref callback, say)."""

_deferred: Dict[int, Tuple[object, bool, float]] = {}
"""signal -> (the previous handler, still to be called; whether ours was put back only to call
it; when the signal came): see _inside_del."""


def _inside_del(frame) -> bool:
    """Whether ``frame`` runs inside a ``__del__``. A signal lands between any two bytecodes,
    also those of a ``__del__`` (a dropped handle, the GC). An exception that the previous
    handler raises there (KeyboardInterrupt, SystemExit) cannot leave the ``__del__``: Python
    prints it as "Exception ignored" and runs on, and the job would not stop."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def raise_if_interrupted(closed_by: Optional[int]) -> None:
    """For an object closed by the cleaners of signal ``closed_by``: raise KeyboardInterrupt
    if that was SIGINT (see ``interrupted``)."""
    if closed_by == signal.SIGINT:
        raise KeyboardInterrupt


DEFER_FOR_S = 10.0
"""How long a signal that keeps landing inside ``__del__`` methods is delivered again."""


def _deliver_after_del(signum: int, since: float) -> None:
    """On a helper thread: deliver ``signum`` to the main thread again once its current frame
    runs inside no ``__del__`` (and so outside the handler that started this thread). If the
    signal lands in another ``__del__`` after all, the handler defers it again, for up to
    DEFER_FOR_S; after that Python drops it as it would have, and an offloader or engine that
    the cleaners closed raises KeyboardInterrupt at its next use (raise_if_interrupted)."""
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        if frame is None:  # the main thread is gone
            return
        if not _inside_del(frame) or time.monotonic() - since > DEFER_FOR_S:
            break
        del frame
        time.sleep(0.0005)
    del frame
    if signum in _deferred:  # else a later signal of the same kind has delivered it
        _thread.interrupt_main(signum)


def _on_signal(signum, frame) -> None:
    if signum in _deferred:  # the previous handler waited for a __del__ to end
        prev, put_back, since = _deferred.pop(signum)
    else:
        prev = _previous.get(signum)
        put_back, since = False, time.monotonic()
    if prev == signal.SIG_IGN:  # ignored before us: the job goes on, and so does the offloader
        return
    if not callable(prev):  # default action: clean up, then die of the same signal
        _clean_for(signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _inside_del(frame) and time.monotonic() - since <= DEFER_FOR_S:
        # Call it once the __del__ is over: deliver the signal again, to this handler, from a
        # helper thread that waits for the main thread to leave it. Not from here: a signal
        # delivered from this thread is handled at its next bytecode checkpoint, inside this
        # handler. (If the cleaners removed ours meanwhile, it is put back for that.)
        if signal.getsignal(signum) is not _on_signal:
            signal.signal(signum, _on_signal)
            put_back = True
        _deferred[signum] = (prev, put_back, since)
        threading.Thread(target=_deliver_after_del, args=(signum, since), daemon=True,
                         name="ssdtrain-signal").start()
        return
    if put_back and signal.getsignal(signum) is _on_signal:
        signal.signal(signum, prev)
    try:
        prev(signum, frame)
    except BaseException:
        # The handler ends the job (KeyboardInterrupt, SystemExit): the files go before the
        # exception unwinds it.
        _clean_for(signum)
        raise
    # It returned: the job goes on (a preemption handler saves a checkpoint first), and needs
    # its offloader until it ends; the files go at exit or uninstall().
    if signum not in _forwarded:
        _forwarded.add(signum)
        log.info("ssdtrain: %s passed on to %s, which lets the job go on: offload goes on, "
                 "and its files are removed when the job ends",
                 signal.Signals(signum).name, getattr(prev, "__qualname__", prev))


_forwarded: set = set()  # signals whose forwarding was logged (once each)


def _clean_for(signum: int) -> None:
    """Run the cleaners for signal ``signum`` (see ``interrupted``)."""
    global interrupted
    interrupted = signum
    try:
        _run_all()
    finally:
        interrupted = None
