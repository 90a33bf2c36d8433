"""SIGTERM ends a verb as Ctrl-C does, and neither is lost in a finalizer.

A job scheduler, ``kill`` or a container stop sends SIGTERM; :func:`sigterm_as_interrupt` makes it raise
:class:`Terminated` (a ``KeyboardInterrupt``) where the main thread is, so a verb unwinds the same way for both: temp
outputs removed, servers stopped, one line, exit 143 (130 for SIGINT).

Python runs a signal's handler at the next bytecode of the main thread. When that bytecode belongs to a finalizer
(``__del__``, a weakref callback, run by the garbage collector in the middle of anything), the exception the handler
raises cannot propagate: Python prints "Exception ignored in ..." and carries on, and the interrupt is lost (a build
sent SIGTERM while ``regex`` freed a pattern ran to the end and exited 0). :func:`sigterm_as_interrupt` therefore also
wraps ``sys.unraisablehook``: an interrupt dropped that way is delivered again, a moment later, from a short-lived
thread (``_thread.interrupt_main``), so that its handler runs after the finalizer has returned; one dropped again is
delivered again.
"""
from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, as SIGINT raises KeyboardInterrupt."""


def _terminated(signum, frame) -> None:
    raise Terminated


REDELIVERY_S = 0.05  # long enough for a finalizer to return (the handler must not run inside it again)


def _redeliver(previous):
    def hook(unraisable) -> None:
        exc_type = unraisable.exc_type
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # not from this thread: the handler would run at the hook's next bytecode, inside the finalizer still
            sig = signal.SIGTERM if issubclass(exc_type, Terminated) else signal.SIGINT
            try:
                timer = threading.Timer(REDELIVERY_S, _thread.interrupt_main, (sig,))
                timer.daemon = True
                timer.start()
            except RuntimeError:  # the interpreter is shutting down: the interrupt has nothing left to stop
                pass
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs in the main thread: SIGTERM raises :class:`Terminated`, and an interrupt (SIGTERM or
    SIGINT) swallowed by a finalizer is raised again after it. Elsewhere (a worker thread, where Python delivers no
    signal) nothing changes. The previous handler and hook are restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_handler = signal.signal(signal.SIGTERM, _terminated)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _redeliver(previous_hook)
    try:
        yield
    finally:  # in-process callers (tests, a job's body) get their own handler and hook back
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous_handler)
