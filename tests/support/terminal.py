"""A pseudo-terminal for the hangup tests: a command as its session leader, what it shows, the hangup."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import time

from tests.support.common import REPO


def in_pty(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Run ``argv`` as the session leader of a new pseudo-terminal; return (pid, master fd)."""
    pid, fd = pty.fork()
    if pid == 0:  # child: exec at once (nothing of pytest runs here)
        try:
            # a login shell starts with default dispositions; under nohup or a background job the test
            # runner may have inherited SIGHUP/SIGINT ignored, which exec would pass on to the "terminal"
            for sig in (signal.SIGHUP, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            os.chdir(REPO)
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid, fd


def read_until(fd: int, pattern: str, timeout: float) -> str:
    """What the terminal showed, once it matches the regular expression ``pattern``."""
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the terminal's other side is gone
                break
            if not chunk:
                break
            out += chunk
            if re.search(pattern, out.decode(errors="replace")):
                return out.decode(errors="replace")
    raise AssertionError(f"no {pattern!r} on the terminal within {timeout:.0f} s; got:\n{out.decode(errors='replace')}")


def hang_up(pid: int, fd: int, timeout: float = 30) -> int:
    """Close the terminal (as when an SSH session ends); return how its session leader ended."""
    os.close(fd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the terminal's shell outlived the hangup")
