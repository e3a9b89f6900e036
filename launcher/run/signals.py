"""The stop signals a supervisor receives, and who sent them.

A Python signal handler learns only the signal's number. To record who sent a stop signal, the supervisor
blocks SIGTERM, SIGINT and SIGHUP while it runs and takes them with ``signal.sigtimedwait`` (its waits
between polls), which hands back the kernel's ``siginfo_t``: the sender's pid and uid and how it was sent
(``si_code``; sigtimedwait(2), sigaction(2)). The sender is named at once, while it may still be alive:

- ``si_code`` SI_KERNEL: the kernel sent it: a terminal that closed (SIGHUP) or Ctrl-C in it (SIGINT);
- ``si_pid`` 0 from ``kill()``: a process outside this pid namespace, i.e. the container engine
  (``docker stop``, ``docker compose stop``) or someone on the host;
- any other pid: that process, with its command line (psutil) and the sender's uid.

A process-directed signal goes to any thread that does not block it, and a thread starts with the mask of
the thread that made it. The libraries a supervisor loads make threads of their own (numpy's BLAS pool,
pyarrow's allocator: four by the time the job runs), so a supervising verb calls ``hold_stop_signals()``
first, while the process has one thread: every thread made after blocks the stop signals too, and
``sigtimedwait`` is the one way they are taken. Until the run's folder is made (``end_hold_guard``, in
``supervise``), a watcher thread takes them: a stop then ends the command at once (``StopRequested``, exit
128 + the signal), with no run made, as it did before the hold. Any other ``launcher`` process starts with
them unblocked, whatever it inherited (preflight's kernel check is a child of a supervisor).

A blocked signal stays blocked across fork and exec, so the job is spawned inside ``unblocked()``, which
restores the mask the process had before the hold (the job's processes must die of SIGTERM as before). A
signal that arrives in that window still reaches the plain handler installed alongside, which records the
signal with an unknown sender: never lost, only less precisely named.

Work that blocks without polling (preflight: its checks, the kernel check's child process it waits for)
runs inside ``interrupting()``: the signals stay blocked, a watcher thread takes them with ``sigtimedwait``
(sender and all) and wakes the main thread with ``WAKE_SIGNAL``, whose handler raises ``StopRequested``
there, once; that ends the work at once (a blocking wait is interrupted; ``subprocess.run`` kills its child
on the way out).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# si_code of a signal the kernel itself sent (Linux, include/uapi/asm-generic/siginfo.h); not in the signal module
SI_KERNEL = 0x80
_CMDLINE_CHARS = 160
# sent by ``interrupting``'s watcher to the main thread only (pthread_kill): not a stop signal, so never blocked
WAKE_SIGNAL = signal.SIGUSR1
_WATCH_POLL_S = 0.1  # how often the watcher looks whether the work it guards has ended
_BEFORE_HOLD: list[set[int]] = []  # the signal mask the process had before hold_stop_signals
_GUARD: list[_Watcher] = []  # the hold's watcher, until the run's folder is made


class SignalInterrupt(KeyboardInterrupt):
    """A stop signal taken as Ctrl-C is (``interrupt_on_signal``); ``signum`` gives the exit status, 128 + it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupt_on_signal(signum: int, frame: Any) -> None:
    """A handler for the stop signals that interrupts the main thread as Ctrl-C does, naming the signal."""
    raise SignalInterrupt(signum)


def hold_stop_signals() -> None:
    """Block the stop signals in the calling (main) thread, for good: call it first in a process that will
    supervise, before it loads anything that makes threads, so that every thread it makes blocks them too. The
    mask from before, less the stop signals, is what ``StopSignals.unblocked`` gives the job: its processes die
    of them even when a process that held them started this one. Until ``end_hold_guard``, a stop signal
    raises ``StopRequested`` in the main thread (the command ends; nothing was started)."""
    if not _BEFORE_HOLD:
        _BEFORE_HOLD.append(signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) - set(STOP_SIGNALS))
        _GUARD.append(_Watcher(STOP_SIGNALS).start())


def end_hold_guard() -> None:
    """The run's folder is about to be made: from here a stop signal waits for the supervisor's ``StopSignals``
    (which records it). Raises ``StopRequested`` when the guard took one (its wake-up may not have come yet)."""
    while _GUARD:
        received = _GUARD.pop().stop()
        if received is not None:
            raise StopRequested(received.signum)


def drop_hold() -> None:
    """This process will not supervise after all (``launcher resume --foreground`` on the host of a container run:
    the run resumes in a new container): the hold ends and the stop signals act as they did before it (Ctrl-C is a
    KeyboardInterrupt again). A stop the guard took before raises ``StopRequested`` (nothing was started yet)."""
    end_hold_guard()
    release_stop_signals()


def release_stop_signals() -> None:
    """A ``launcher`` process that does not supervise: the stop signals unblocked, whatever it inherited (a
    child of a supervisor that held them, such as preflight's kernel check, must die of them)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class StopRequested(BaseException):  # noqa: N818  (not an error: how blocking work is left on a stop)
    """Raised inside ``StopSignals.interrupting`` (or the hold's guard) when a stop signal arrives. A
    BaseException, so that a check's ``except Exception`` (a crashed check is a failed row) does not swallow it."""

    @property
    def signum(self) -> int:
        return int(self.args[0])

    def before_the_run(self) -> str:
        """The one line for a stop that came before the run was made."""
        return f"stopped by {signal.Signals(self.signum).name} before a run was made; nothing was started"


@dataclass(frozen=True)
class Received:
    """One stop signal: its number, and who sent it as far as the kernel said (None: not known)."""

    signum: int
    pid: int | None = None
    uid: int | None = None
    code: int | None = None
    cmdline: str | None = None  # the sender's, read when the signal arrived

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def describe(self) -> str:
        """Who sent it, in a line for the record (``stopped_by``)."""
        if self.code == SI_KERNEL or (self.code is None and self.signum in (signal.SIGHUP, signal.SIGINT)):
            known = {signal.SIGHUP: "the terminal closed (SIGHUP)", signal.SIGINT: "Ctrl-C in the terminal (SIGINT)"}
            return known.get(self.signum, f"{self.name} from the kernel")
        if self.code is None:  # the plain handler's: the kernel did not say
            return f"{self.name} from a sender the launcher could not see (docker stop, docker compose stop, kill)"
        if self.pid == 0:
            return (
                f"{self.name} from outside this pid namespace (si_pid 0: the container engine, e.g. docker stop "
                f"or docker compose stop, or a process on the host; uid {self.uid})"
            )
        what = self.cmdline if self.cmdline else "ended before it could be named"
        return f"{self.name} from pid {self.pid} ({what}, uid {self.uid})"

    def to_dict(self) -> dict[str, Any]:
        return {"signal": self.signum, "pid": self.pid, "uid": self.uid, "si_code": self.code, "cmdline": self.cmdline}


def _cmdline(pid: int) -> str | None:
    try:
        words = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError):
        return None
    text = " ".join(words)
    return text if len(text) <= _CMDLINE_CHARS else text[: _CMDLINE_CHARS - 3] + "..."


def from_siginfo(info: Any) -> Received:
    """A ``signal.struct_siginfo`` as a ``Received``, naming the sender while it may still be alive."""
    pid = int(info.si_pid)
    cmdline = "the supervisor itself" if pid == os.getpid() else _cmdline(pid) if pid > 0 else None
    return Received(int(info.si_signo), pid=pid, uid=int(info.si_uid), code=int(info.si_code), cmdline=cmdline)


def take(signals: tuple[int, ...], timeout: float) -> Received | None:
    """A blocked stop signal, taken with its sender (``sigtimedwait``) within ``timeout`` seconds, or None.

    ``sigtimedwait`` returns only signals of the set. A record whose ``si_signo`` is none of them (seen once: a
    Slurm node's launcher, under load in a test cluster, read 1111501904 and stopped itself, with nobody stopping
    it) names no stop signal: it is reported on stderr and taken as none, rather than as a stop nobody sent."""
    info = signal.sigtimedwait(signals, max(0.0, timeout))
    if info is not None and info.si_signo not in signals:
        wanted = ", ".join(str(int(s)) for s in signals)
        print(
            f"launcher: sigtimedwait gave si_signo {info.si_signo}, not a stop signal ({wanted}); ignored",
            file=sys.stderr,
            flush=True,
        )
        return None
    return None if info is None else from_siginfo(info)


class _Watcher:
    """A thread that takes the stop signals (blocked everywhere) with ``sigtimedwait`` and wakes the main thread
    with ``WAKE_SIGNAL``, whose handler raises ``StopRequested`` there, once. Made and started in the main
    thread (only it may set a handler); the handler stays set after ``stop`` (a late wake-up does nothing)."""

    def __init__(self, signals: tuple[int, ...], keep: Callable[[Received], None] | None = None):
        self.signals, self._keep = signals, keep
        self.received: Received | None = None
        self._armed = True
        self._main = threading.get_ident()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stop-signal-watcher", daemon=True)

    def start(self) -> _Watcher:
        signal.signal(WAKE_SIGNAL, self._on_wake)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.is_set():
            self.received = take(self.signals, _WATCH_POLL_S)
            if self.received is not None:
                if self._keep is not None:
                    self._keep(self.received)
                signal.pthread_kill(self._main, WAKE_SIGNAL)
                return

    def disarm(self) -> bool:
        """No ``StopRequested`` from this watch any more; whether one could still have come (one at most)."""
        armed, self._armed = self._armed, False
        return armed

    def _on_wake(self, _signum: int, _frame: Any) -> None:  # in the main thread
        if self.received is not None and self.disarm():
            raise StopRequested(self.received.signum)

    def stop(self) -> Received | None:
        """End the watch; the signal it took, if one came."""
        self.disarm()
        self._done.set()
        self._thread.join()
        return self.received


class StopSignals:
    """While entered: SIGTERM, SIGINT and SIGHUP are blocked and taken by ``wait``; the first one is kept
    (``first``). On exit, signals still pending are taken (they would otherwise be delivered to the handlers
    restored then), and the previous handlers and mask come back."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.first: Received | None = None
        self._handlers: dict[int, Any] = {}
        self._mask: set[int] | None = None
        self._watcher: _Watcher | None = None  # ``interrupting``'s, while it runs

    def _keep(self, received: Received) -> None:
        if self.first is None:
            self.first = received

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._keep(Received(signum))
        # inside ``interrupting`` without the hold, a thread that does not block the signal may take it
        if self._watcher is not None and self._watcher.disarm():
            raise StopRequested(signum)

    def __enter__(self) -> StopSignals:
        self._handlers = {s: signal.signal(s, self._on_signal) for s in self.signals}
        self._handlers[WAKE_SIGNAL] = signal.getsignal(WAKE_SIGNAL)  # ``interrupting``'s watchers set it
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        self._mask = _BEFORE_HOLD[0] if _BEFORE_HOLD else mask
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._drain()
        for s, handler in self._handlers.items():
            signal.signal(s, handler)
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)

    def wait(self, timeout: float) -> Received | None:
        """Wait up to ``timeout`` seconds (0: not at all) for a stop signal: the supervisor's sleep between polls."""
        received = take(self.signals, timeout)
        if received is not None:
            self._keep(received)
        return received

    def _drain(self) -> None:
        while self.wait(0) is not None:
            pass

    @contextmanager
    def interrupting(self) -> Iterator[None]:
        """Run blocking work here, in the main thread: a stop signal (also one already pending) raises
        ``StopRequested`` in it. The signals stay blocked (a thread the work makes inherits the block); a
        watcher thread takes them, with their sender, and wakes the main thread."""
        self._drain()
        if self.first is not None:
            raise StopRequested(self.first.signum)
        self._watcher = _Watcher(self.signals, keep=self._keep).start()
        try:
            yield
        finally:
            self._watcher.stop()
            self._watcher = None

    @contextmanager
    def unblocked(self) -> Iterator[None]:
        """Spawn children here: they start with the mask the process had before ``hold_stop_signals`` (or, without
        the hold, before ``__enter__``)."""
        self._drain()  # a pending signal would be delivered to the plain handler at the unblock
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
