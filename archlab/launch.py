"""The ``archlab`` command. A Ctrl-C or SIGTERM while Python loads torch and the command's modules
(a second or more) ends it then, with the shell's status and no word: nothing has begun. Python's
own handler raised KeyboardInterrupt inside the imports, and printed its traceback."""

import os
import signal

STARTUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _end_now(signum, frame) -> None:
    os._exit(128 + signum)


def main() -> None:
    before = {signum: signal.signal(signum, _end_now) for signum in STARTUP_SIGNALS}
    from archlab.cli import main as run_command

    for signum, handler in before.items():
        signal.signal(signum, handler)
    run_command()
