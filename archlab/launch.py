"""The ``archlab`` command, as it starts. A Ctrl-C or SIGTERM while Python loads torch and the
command's modules (a second or more) ends it then, with the shell's status and no word: nothing has
begun (Python's own handler raised KeyboardInterrupt inside the imports, and printed its
traceback). An import the system fails (a full disk) is said in a line."""

import os
import signal
import sys

STARTUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _end_now(signum, frame) -> None:
    os._exit(128 + signum)


def main() -> None:
    before = {signum: signal.signal(signum, _end_now) for signum in STARTUP_SIGNALS}
    try:
        from archlab.cli import main as run_command
    except OSError as exc:  # a disk with no room for the temporary file torch's imports make, among others
        sys.stderr.write(f"error: archlab could not load its modules: {exc}\n")
        sys.exit(1)
    for signum, handler in before.items():
        signal.signal(signum, handler)
    run_command()
