"""The ``archlab`` command, as it starts and as it ends. A Ctrl-C or SIGTERM while Python loads
torch and the command's modules (a second or more) ends it then, with the shell's status and no
word: nothing has begun (Python's own handler raised KeyboardInterrupt inside the imports, and
printed its traceback). One once the command is done ends the process then, with the command's
own status: its work is whole (Python's shutdown, which it cut, printed a KeyboardInterrupt from
an atexit callback of torch's, or was ended by SIGTERM as if the command had failed), as does one
that lands past the command's own handling of it, as the command returns (a traceback, and a
process ended by SIGINT). Past the last atexit callback one is ignored, and the process ends as it
would have a moment later. An import the system fails (a full disk) is said in a line."""

import atexit
import contextlib
import os
import signal
import sys

from archlab.interrupts import HELD, interrupted_status


def _end_now(status: int) -> None:
    """Leave at once with ``status``, what was written flushed (os._exit skips Python's shutdown)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, RuntimeError):  # closed, or cut in the middle of a write
            stream.flush()
    os._exit(status)


def _status(stop: SystemExit) -> int:
    """The status Python exits with for ``stop``."""
    return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1


TEARDOWN_LIMIT_S = 60  # seconds Python may take to tear down once the command is done: it takes about half of one


def _ignore_stops() -> None:
    """SIGINT and SIGTERM ignored from here on. Registered before torch is imported, this is the
    last atexit callback to run; after it Python puts back the default handlers of those it
    handled, and a signal in the half second it then takes to tear torch down ended the process by
    the signal, though the command was done. A teardown that hangs, which those signals no longer
    stop, is ended by SIGALRM after TEARDOWN_LIMIT_S (no Python code runs so late to end it)."""
    for signum in HELD:
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(TEARDOWN_LIMIT_S)


def main() -> None:
    atexit.register(_ignore_stops)
    before = {signum: signal.signal(signum, lambda signum, frame: _end_now(128 + signum)) for signum in HELD}
    try:
        from archlab.cli import main as run_command
    except OSError as exc:  # a disk with no room for the temporary file torch's imports make, among others
        sys.stderr.write(f"error: archlab could not load its modules: {exc}\n")
        sys.exit(1)
    for signum, handler in before.items():
        signal.signal(signum, handler)
    status = 1  # an exception let out: Python prints it and exits with 1
    try:
        run_command()
        status = 0
    except SystemExit as stop:
        status = _status(stop)
        raise
    except KeyboardInterrupt as exc:  # one that lands past the command's own handling, as it returns
        status = interrupted_status(exc)
        sys.exit(status)
    finally:
        for signum in HELD:
            signal.signal(signum, lambda signum, frame: _end_now(status))
