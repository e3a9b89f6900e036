"""The launcher's one error type and its named exit codes.

Anything a user can get wrong (a config, a run id, a run that cannot be resumed, a live run holding the
lock) raises ``LauncherError`` with a message that says what is wrong, shows the value and gives the
fix. The command line prints it once (``error: ...``) and exits with its code; nothing else prints it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of every ``launcher`` verb (a run's own end adds 128 + signal for a stop)."""

    OK = 0
    FAILED = 1  # the run or the check ran and failed (a FAIL row, a failed run)
    USAGE = 2  # bad input: config, arguments, a run that is not there or cannot be resumed
    REFUSED = 3  # another run is live (the lock), or its processes are


class LauncherError(Exception):
    """A problem the user can fix; ``message`` says how, ``exit_code`` is what the command returns."""

    def __init__(self, message: str, exit_code: int = ExitCode.USAGE):
        super().__init__(message)
        self.message = message
        self.exit_code = int(exit_code)

    def __str__(self) -> str:
        return self.message


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str | None:
    """``did you mean PREFIXNAME?`` for the one of ``choices`` closest to a misspelt ``word`` (difflib's ratio of at
    least 0.6), None when none is that close. One wording for every unknown key the launcher refuses."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean {prefix}{close[0]}?" if close else None
