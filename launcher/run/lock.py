"""The run lock: at most one live run per output root (one server's devices).

A kernel lock (filelock, ``flock``) on ``<output_root>/launcher.lock``, taken without waiting. The
kernel releases it when the holder dies, however it dies; the lock file itself is never deleted or
truncated. Who holds it is written *after* acquiring, into a separate ``launcher.lock.owner.json``,
and is only a hint for messages: liveness is always judged from the processes themselves.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from launcher.errors import ExitCode, LauncherError
from launcher.files import make_folder, read_json_object, shown, type_problem, write_json_atomic
from launcher.state.procs import boot_id, find_live, pid_namespace, self_identity
from launcher.state.record import Identity, now_iso
from launcher.state.runs import STATUS_FILE

LOCK_NAME = "launcher.lock"
OWNER_NAME = "launcher.lock.owner.json"
OWNER_MAX_BYTES = 64 << 10  # the holder writes a few hundred bytes


class Owner(Identity, total=False):
    """The lock's owner file (``RunLock.write_owner``): the holder's identity, its run and where; a file with a
    key of another type gives no hint (``read_owner``)."""

    run_id: str | None
    run_dir: str | None
    hostname: str
    boot_id: str | None
    since: str


class LockBusy(LauncherError):
    """Another process holds the run lock; ``owner`` is what it wrote about itself (may be empty)."""

    def __init__(self, lock_path: Path, owner: dict[str, Any]):
        self.lock_path = lock_path
        self.owner = owner
        if owner.get("run_id"):
            who = (
                f"run {owner.get('run_id')} (supervisor pid {owner.get('pid')} on {owner.get('hostname')}, "
                f"since {owner.get('since')}, run dir {owner.get('run_dir')})"
            )
        elif owner:  # the holder is still validating its config; its run folder does not exist yet
            who = (
                f"a run being set up (supervisor pid {owner.get('pid')} on {owner.get('hostname')}, "
                f"since {owner.get('since')})"
            )
        else:
            who = "a process that has not written its identity yet"
        who = shown(who)  # the owner file is outside text: one line, no escape sequences
        super().__init__(
            f"another run is live: {who}. Follow it with `launcher status`, or stop it with "
            + (f"`launcher stop {owner['run_id']}`" if owner.get("run_id") else "`launcher stop`")
            + f" (lock: {lock_path})",
            ExitCode.REFUSED,
        )


class RunLock:
    """A held run lock. Release it only after the run's terminal record is on disk."""

    def __init__(self, root: Path):
        make_folder(root, "launcher.output_root")
        self.path = root / LOCK_NAME
        self.owner_path = root / OWNER_NAME
        self._lock = FileLock(str(self.path), timeout=0, thread_local=False)

    def acquire(self) -> RunLock:
        """Take the lock without waiting; raise ``LockBusy`` naming the holder if it is taken."""
        _take(self._lock, self.path)
        self.describe(None, None)  # at once: until the run folder exists, an earlier run's owner file is stale
        return self

    def describe(self, run_id: str | None, run_dir: Path | None) -> None:
        """Record who holds the lock (written after acquiring; a hint for messages)."""
        write_json_atomic(
            self.owner_path,
            {
                **self_identity(),
                "run_id": run_id,
                "run_dir": str(run_dir) if run_dir else None,
                "hostname": socket.gethostname(),
                "boot_id": boot_id(),
                "since": now_iso(),
            },
        )

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release(force=True)

    @property
    def held(self) -> bool:
        return self._lock.is_locked


def read_owner(root: Path) -> dict[str, Any]:
    """What the lock holder wrote about itself; empty if unreadable or if that process is not alive
    (an earlier run's file, read in the instant before a new holder rewrites it). A holder in another
    pid namespace (another container) cannot be checked from here and is taken at its word."""
    data = read_json_object(root / OWNER_NAME, max_bytes=OWNER_MAX_BYTES)
    if isinstance(data, str) or type_problem(data, Owner):  # unreadable or of the wrong shape: no hint
        return {}
    if data.get("pid_ns") not in (None, pid_namespace()):
        return data
    return data if find_live(data) is not None else {}


def _take(lock: FileLock, path: Path) -> None:
    """Take ``lock`` on ``path`` without waiting.

    Raises:
        LockBusy: another process holds it.
        LauncherError (USAGE): ``path`` is a link or not a file the lock can be taken on, in one line.
    """
    if path.is_symlink():  # filelock opens it without following (O_NOFOLLOW): ELOOP, a traceback
        raise LauncherError(
            f"the run lock {shown(path)} is a symbolic link (to {shown(os.readlink(path))}), not "
            f"the file the launcher makes; nothing was started. Remove the link (`rm {shown(path)}`) "
            "and run again",
            ExitCode.USAGE,
        )
    try:
        lock.acquire(blocking=False)
    except Timeout:
        raise LockBusy(path, read_owner(path.parent)) from None
    except OSError as err:  # not a file the lock can be taken on (a folder, no permission)
        raise LauncherError(
            f"cannot take the run lock {shown(path)} ({shown(err.strerror or err)}); nothing was started. "
            "It must be a regular file the launcher can open for writing: remove what is there or fix its "
            "permissions",
            ExitCode.USAGE,
        ) from None


def check_free(root: Path) -> None:
    """Refuse at once when the lock of ``root`` is held or cannot be taken (takes and drops it if free; never
    waits); the supervisor checks again under the lock.

    Raises:
        LockBusy: a live run holds it.
        LauncherError (USAGE): the lock file is a link or cannot be opened.
    """
    path = root / LOCK_NAME
    if not path.exists() and not path.is_symlink():
        return
    probe = FileLock(str(path), timeout=0, thread_local=False)
    _take(probe, path)
    probe.release(force=True)


def is_locked(root: Path) -> bool:
    """Whether some process holds the lock of ``root`` now (``check_free``; a lock file that is a link or
    cannot be opened raises its one-line ``LauncherError``)."""
    try:
        check_free(root)
    except LockBusy:
        return True
    return False


def being_set_up(root: Path) -> dict[str, Any] | None:
    """What the lock's holder wrote about itself while it is still setting its run up (it holds the lock, and its
    run folder does not exist yet: the config is being checked); None otherwise, or when the lock cannot be probed
    from here (a lock file this user cannot open)."""
    owner = read_owner(root)
    if not owner or (owner.get("run_id") and _recorded(root, owner)):
        return None
    try:
        return owner if is_locked(root) else None
    except (OSError, LauncherError):  # a lock file this user cannot open (or a link): no wait, no refusal
        return None


def _recorded(root: Path, owner: dict[str, Any]) -> bool:
    """Whether the run the owner names has its record yet (the supervisor names it just before writing it)."""
    return (root / str(owner["run_id"]) / STATUS_FILE).is_file()


def wait_for_run_id(root: Path, timeout_s: float, every_s: float = 0.5) -> str | None:
    """The run id the lock's holder names once its run folder holds its record; None when it let go of the lock
    first (its config was refused) or ``timeout_s`` passed. Polls the owner file and the lock, never takes a held
    lock."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        owner = read_owner(root)
        if owner.get("run_id") and _recorded(root, owner):
            return str(owner["run_id"])
        try:
            if not is_locked(root):
                return None
        except (OSError, LauncherError):
            return None
        time.sleep(every_s)
    return None
