"""Work that a Ctrl-C or SIGTERM must not cut in two."""

from __future__ import annotations

import signal
import threading
from contextlib import ExitStack, contextmanager

HELD = (signal.SIGINT, signal.SIGTERM)  # what stops a command: Ctrl-C, and a scheduler's or torchrun's stop


class Terminated(KeyboardInterrupt):
    """SIGTERM, as Ctrl-C."""


def interrupted_status(exc: KeyboardInterrupt) -> int:
    """The shell's status for a process ended by the signal: 128 + SIGTERM, or + SIGINT."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


@contextmanager
def held_signals():
    """SIGINT and SIGTERM held while the body runs, then the first that came delivered, by the
    handler they had before. Only the main thread is interrupted: in another this holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []

    def deliver() -> None:
        for signum in came[:1]:
            signal.raise_signal(signum)

    with ExitStack() as restore:  # each handler put back even if a signal lands while another is
        restore.callback(deliver)  # last, once both handlers are back
        for signum in HELD:
            restore.callback(signal.signal, signum, signal.signal(signum, lambda signum, frame: came.append(signum)))
        yield
