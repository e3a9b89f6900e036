"""Device leases: at most one run per accelerator on a host, whatever runs folder, user or container it comes from.

The run lock (``run/lock.py``) keeps one live run per runs folder; two runs folders (two users, two clones, two
containers with other ``OUTPUTS_DIR``) each have their own. A lease is what they share: one kernel lock per device
(``flock``, ``_flock``) in a host-wide folder, named by the device's stable identity (``state/devices.py``: a GPU's
UUID, an NPU's bus id), taken without waiting by a run's supervisor before the job starts and given up after the
end record, as the run lock is. The kernel drops a dead holder's locks at once, however it died. Who holds a
lease is written after acquiring, into an owner file per device and user (``<device>.owner-<uid>.json``: in a
folder with the sticky bit one user cannot replace another's file); it is a hint for messages and
``launcher list --devices``, never the judge: the lock is.

The folder: ``$LAUNCHER_LEASE_DIR``, else ``/tmp/deltanet-launcher-leases``, made with mode 1777 (every user may
make files, none may remove another's, as /tmp itself); compose mounts the same host folder into every container.
What it protects and what it does not: docs/devices.md.
"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import Any

from launcher.errors import ExitCode, LauncherError
from launcher.files import read_json_object, shown, write_json_atomic
from launcher.state.devices import Device
from launcher.state.procs import container_identity, find_live, pid_namespace, self_identity
from launcher.state.record import now_iso

BUSY_WAIT_S = 1.0  # a held lock is tried again this long: `list --devices` probes each lock for an instant
LEASE_DIR_ENV = "LAUNCHER_LEASE_DIR"
DEFAULT_LEASE_DIR = Path(os.sep, "tmp", "deltanet-launcher-leases")  # the same path on the host and in containers
OWNER_MAX_BYTES = 64 << 10


def lease_dir() -> Path:
    """Where the leases of this host are (``$LAUNCHER_LEASE_DIR``, else ``DEFAULT_LEASE_DIR``)."""
    return Path(os.environ.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR)


def _slug(identity: str) -> str:
    """A file name for a device identity: readable, and unique through a short hash of the whole identity."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", identity)[:80]
    return f"{readable}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # a uid without a name (a container's user): the number
        return str(os.getuid())


class LeaseBusy(LauncherError):
    """A device the run asks for is leased by another run; the message names the holder and how to reach it."""

    def __init__(self, device: Device, owner: dict[str, Any], folder: Path):
        self.device, self.owner = device, owner
        if owner.get("run_id") or owner.get("pid"):
            run = owner.get("run_id") or "a run being set up"
            root = owner.get("runs_root") or "?"
            who = (
                f"run {run} of user {owner.get('user', '?')} (runs folder {root}, devices "
                f"{', '.join(owner.get('host_indices') or []) or '?'}, supervisor pid {owner.get('pid')} on "
                f"{owner.get('hostname', '?')}, since {owner.get('since', '?')})"
            )
            how = (
                f"follow it with `launcher status {owner.get('run_id')} --root {root}`, stop it with "
                f"`launcher stop {owner.get('run_id')} --root {root}`"
                if owner.get("run_id")
                else "`launcher list --devices` shows it once its run folder exists"
            )
        else:
            who, how = "a process that has not written who it is", "`launcher list --devices` shows the leases"
        super().__init__(
            shown(
                f"device {device.host_index} ({device.identity}) is leased by {who}; {how}. Pick other devices "
                f"({'CUDA_VISIBLE_DEVICES' if device.kind == 'cuda' else 'ASCEND_RT_VISIBLE_DEVICES'}) or wait "
                f"(leases: {folder})"
            ),
            ExitCode.REFUSED,
        )


def _folder(path: Path) -> Path:
    """The lease folder, made world-writable with the sticky bit when it is new.

    Raises:
        LauncherError (USAGE): it cannot be made or used (a file or a link in its place, no permission).
    """
    try:
        if path.is_symlink():
            raise OSError(0, f"a symbolic link to {os.readlink(path)}")
        if not path.exists():
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o1777)
        if not path.is_dir():
            raise OSError(0, "not a folder")
        st = path.stat()
        if st.st_mode & 0o7777 != 0o1777 and os.getuid() in (0, st.st_uid):  # made by compose (0755) or by hand
            os.chmod(path, 0o1777)
        if not os.access(path, os.W_OK | os.X_OK):
            raise OSError(0, f"not writable by {_user()}")
    except OSError as err:
        raise LauncherError(
            f"the device lease folder {shown(path)} cannot be used ({shown(err.strerror or err)}); nothing was "
            f"started. Every run on this host leases its devices there: make it a folder every user may write "
            f"(its owner or root: `mkdir -p {shown(path)} && chmod 1777 {shown(path)}`), or point {LEASE_DIR_ENV} "
            "at one (the same for every user and "
            "container of the host)",
            ExitCode.USAGE,
        ) from None
    return path


class DeviceLease:
    """The leases of one run on its devices: all taken, or none."""

    def __init__(self, devices: list[Device], folder: Path | None = None):
        self.devices = sorted(devices, key=lambda d: d.identity)  # one order for every run: no lock-order surprise
        self.folder = folder or lease_dir()
        self._locks: list[tuple[Device, int]] = []  # each device's lock file descriptor, flock held

    def acquire(self, runs_root: Path) -> DeviceLease:
        """Take every device's lease without waiting; on any refusal give back what was taken and raise.

        Raises:
            LeaseBusy (REFUSED): a device is leased by another run (named).
            LauncherError (USAGE): the folder or a lease file cannot be used (one line, with the fix).
        """
        if not self.devices:
            return self
        folder = _folder(self.folder)
        try:
            for device in self.devices:
                path = folder / f"{_slug(device.identity)}.lock"
                _check_lock_file(path)
                try:
                    fd = _flock(path, wait_s=BUSY_WAIT_S)
                except OSError as err:
                    raise _bad_file(path, err) from None
                if fd is None:
                    raise LeaseBusy(device, holder(folder, device), folder)
                self._locks.append((device, fd))
            self.describe(None, None, runs_root)
        except BaseException:
            self.release()
            raise
        return self

    def describe(self, run_id: str | None, run_dir: Path | None, runs_root: Path) -> None:
        """Write who holds the leases (after acquiring; a hint for messages). A refused write is no failure."""
        me = {
            **self_identity(),
            "run_id": run_id,
            "run_dir": str(run_dir) if run_dir else None,
            "runs_root": str(Path(runs_root).resolve()),
            "user": _user(),
            "uid": os.getuid(),
            "hostname": socket.gethostname(),
            "container": (container_identity() or {}).get("name"),
            "since": now_iso(),
            "devices": [d.identity for d in self.devices],
            "host_indices": [d.host_index for d in self.devices],
        }
        for device, _ in self._locks:
            try:
                write_json_atomic(
                    self.folder / f"{_slug(device.identity)}.owner-{os.getuid()}.json",
                    {**me, "device": device.identity, "host_index": device.host_index},
                )
            except OSError:
                pass

    def release(self) -> None:
        for _, fd in reversed(self._locks):
            os.close(fd)  # closing the descriptor drops its flock
        self._locks.clear()

    @property
    def held(self) -> list[str]:
        return [device.identity for device, _ in self._locks]


def _flock(path: Path, wait_s: float = 0.0) -> int | None:
    """A descriptor of ``path`` holding an exclusive ``flock``, or None when another process holds it (tried again
    for ``wait_s``). The file is made mode 0666 for every user, never followed through a link, and opened read-only
    where another user's file cannot be written: a ``flock`` needs no write access.

    Hand-written rather than filelock's: filelock 4 refuses a lock file that another user made in a folder with the
    sticky bit, which is every lease of a shared host.

    Raises:
        OSError: the file cannot be opened (another user's file of mode 0600, a folder in its place).
    """
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, os.O_RDWR | flags, 0o666)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        os.fchmod(fd, 0o666)  # the umask took bits away; only the file's owner (or root) can put them back
    except OSError:
        pass
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)
        except OSError:
            os.close(fd)
            raise


def _check_lock_file(path: Path) -> None:
    """A lease file must be a regular file (never followed through a link: ``_flock`` opens it with O_NOFOLLOW)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise LauncherError(
            f"the device lease file {shown(path)} is a symbolic link (to {shown(os.readlink(path))}), not a file the "
            f"launcher makes; nothing was started. Remove the link (`rm {shown(path)}`) and run again",
            ExitCode.USAGE,
        )
    if not stat.S_ISREG(st.st_mode):
        raise LauncherError(
            f"the device lease file {shown(path)} is not a regular file; nothing was started. "
            "Remove what is there and run again",
            ExitCode.USAGE,
        )


def _bad_file(path: Path, err: OSError) -> LauncherError:
    try:
        import pwd

        owner = pwd.getpwuid(path.stat().st_uid).pw_name
    except (OSError, KeyError):
        owner = "another user"
    return LauncherError(
        f"cannot take the device lease {shown(path)} ({shown(err.strerror or err)}; the file belongs to {owner}); "
        "nothing was started. A lease file must be readable by every user of the host: ask its owner or an admin "
        f"to `chmod 666 {shown(path)}` (or remove it when no run holds it)",
        ExitCode.USAGE,
    )


def holder(folder: Path, device: Device) -> dict[str, Any]:
    """What the holder of ``device``'s lease wrote about itself (``_owner``); empty when none is readable."""
    return _owner(folder, _slug(device.identity))


def _owner(folder: Path, stem: str) -> dict[str, Any]:
    """Of the owner files of lease ``stem``, a live one (one in another pid namespace, which cannot be checked from
    here, is taken at its word), newest first; empty when none is readable."""
    found = []
    for path in folder.glob(f"{stem}.owner-*.json"):
        data = read_json_object(path, max_bytes=OWNER_MAX_BYTES)
        if isinstance(data, str) or not isinstance(data.get("since"), str):
            continue
        if data.get("pid_ns") not in (None, pid_namespace()) or find_live(data) is not None:
            found.append(data)
    return max(found, key=lambda d: d["since"], default={})


def list_leases(folder: Path | None = None) -> list[dict[str, Any]]:
    """The leases held now on this host: one mapping per device (``device``, ``host_index``, ``run_id``,
    ``runs_root``, ``user``, ``since``...), found by trying each lock (taken and given back at once when free)."""
    folder = folder or lease_dir()
    try:
        locks = sorted(p for p in folder.glob("*.lock") if p.is_file() and not p.is_symlink())
    except OSError:
        return []
    held = []
    for path in locks:
        try:
            fd = _flock(path)
        except OSError:
            held.append({"device": path.stem, "note": "the lease file cannot be opened here"})
            continue
        if fd is None:
            held.append(_owner(folder, path.stem) or {"device": path.stem, "note": "holder unknown"})
        else:
            os.close(fd)
    return held
