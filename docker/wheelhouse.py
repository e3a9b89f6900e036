"""Install a hash lock into the image, online or from a wheelhouse; make and check wheelhouses.

    # on a connected machine: every wheel the lock needs on the target platform (one command)
    python3 docker/wheelhouse.py download requirements.lock wheelhouse/npu-aarch64 --platform aarch64

    # in the Dockerfile (WHEELHOUSE: empty = online from PyPI, else a folder under the build
    # context's wheelhouse/, bind-mounted at /wheelhouse so no wheel ends up in a layer)
    python docker/wheelhouse.py install requirements.lock

    # anywhere, before a build: is the wheelhouse complete for the image's platform? (names what is missing)
    python3 docker/wheelhouse.py check requirements.lock wheelhouse/npu-aarch64 --platform aarch64

    # in the Dockerfile: one wheel that no public index carries (triton-ascend 3.6.0), brought into the
    # wheelhouse by the user, installed only when its sha256 equals the value the user pinned
    python docker/wheelhouse.py install-pinned triton-ascend==3.6.0 --sha256 <64 hex digits>

``install`` runs ``pip install --no-cache-dir --no-deps --require-hashes --only-binary=:all: -r LOCK``
and, with a wheelhouse, adds ``--no-index --find-links DIR`` after ``check`` found a wheel with a locked
hash for every entry that applies here; otherwise it stops with one message naming the missing
packages. ``download`` evaluates the lock's markers for the *target* platform (pip would evaluate
them for the machine it runs on) and calls ``pip download --no-deps --require-hashes
--only-binary=:all:`` with ``--platform/--python-version/--implementation/--abi`` for that target.

``install-pinned`` needs ``WHEELHOUSE``: it finds the one wheel of that name and version for this platform there,
compares its sha256 with ``--sha256`` (empty: refused, with the command that prints the hash) and installs it
with ``pip --no-index --require-hashes --no-deps`` against a requirement line carrying that hash, so pip checks
the same value again.

Standalone on purpose: it runs in the image before anything but pip is installed, so it reads the
lock itself (the same format as launcher/lockfile.py) and takes ``packaging`` from pip if needed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # a fresh venv: pip's vendored copy
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.tags import sys_tags  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

# where the Dockerfile bind-mounts the build context's wheelhouse/ (WHEELHOUSE_MOUNT: tests run it elsewhere)
MOUNT = Path(os.environ.get("WHEELHOUSE_MOUNT") or "/wheelhouse")
PIP_FLAGS = ["--no-cache-dir", "--no-deps", "--require-hashes", "--only-binary=:all:"]
# Target machines. Both images run glibc >= 2.35 (CANN's Ubuntu 22.04: 2.35; Debian bookworm: 2.36),
# so every manylinux tag up to 2.35 fits; pip does not expand one --platform to the older tags itself.
MACHINES = ("aarch64", "x86_64")
GLIBC_MINOR = 35


def platform_tags(machine: str) -> list[str]:
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(GLIBC_MINOR, 16, -1)]
    legacy = ["manylinux2014"] + (["manylinux2010", "manylinux1"] if machine == "x86_64" else [])
    return tags + [f"{name}_{machine}" for name in legacy]


@dataclass(frozen=True)
class Entry:
    name: str
    version: str
    marker: str | None
    hashes: frozenset[str]

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


class WheelhouseError(SystemExit):
    def __init__(self, message: str):
        print(f"wheelhouse: {message}", file=sys.stderr)
        super().__init__(1)


def read_lock(path: Path) -> list[Entry]:
    """``name==version ; marker \\`` lines with ``--hash=sha256:...`` continuations (uv/pip-compile)."""
    entries, logical = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        logical += " " + line.rstrip("\\").strip()
        if line.endswith("\\"):
            continue
        words, logical = logical.split(), ""
        if words[0].startswith("-"):
            continue  # an option line such as --index-url
        requirement = " ".join(w for w in words if not w.startswith("--hash="))
        spec, _, marker = requirement.partition(";")
        name, sep, version = spec.strip().partition("==")
        if not sep:
            raise WheelhouseError(f"{path}: {spec.strip()!r} is not pinned with ==")
        hashes = frozenset(w.split(":", 1)[1] for w in words if w.startswith("--hash=sha256:"))
        entries.append(Entry(canonicalize_name(name), version.strip(), marker.strip() or None, hashes))
    return entries


def applies(entry: Entry, environment: dict[str, str] | None) -> bool:
    return entry.marker is None or Marker(entry.marker).evaluate(environment)


def target_environment(machine: str, python: str) -> dict[str, str]:
    return {
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "platform_machine": machine,
        "platform_system": "Linux",
        "sys_platform": "linux",
        "os_name": "posix",
        "python_version": ".".join(python.split(".")[:2]),
        "python_full_version": python,
    }


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def target_tags(machine: str, python: str) -> set:
    """The wheel tags CPython ``python`` on linux ``machine`` (glibc up to 2.GLIBC_MINOR) installs."""
    from itertools import product

    try:
        from packaging.tags import Tag
    except ImportError:
        from pip._vendor.packaging.tags import Tag  # type: ignore[no-redef]

    digits = "".join(python.split(".")[:2])
    interpreters = [
        f"cp{digits}",
        *(f"py{digits[0]}{minor}" for minor in range(int(digits[1:]), -1, -1)),
        f"py{digits[0]}",
    ]
    platforms = [*platform_tags(machine), f"linux_{machine}"]
    tags = {Tag(f"cp{digits}", abi, plat) for abi in (f"cp{digits}", "abi3", "none") for plat in platforms}
    tags |= {Tag(f"cp3{minor}", "abi3", plat) for minor in range(2, int(digits[1:]) + 1) for plat in platforms}
    tags |= {Tag(i, "none", plat) for i, plat in product(interpreters, [*platforms, "any"])}
    return tags


def check(lock: Path, wheelhouse: Path, target: tuple[str, str] | None = None) -> list[str]:
    """Problems (one per missing or unusable package) for installing ``lock`` from ``wheelhouse``: here, or on
    ``target`` (machine, CPython version), as the image's install step will, before a build starts."""
    if not wheelhouse.is_dir():
        return [f"{wheelhouse} is not a folder"]
    supported = set(sys_tags()) if target is None else target_tags(*target)
    environment = None if target is None else target_environment(*target)
    wheels: dict[tuple[str, str], list[tuple[Path, frozenset]]] = {}
    for path in sorted(wheelhouse.iterdir()):
        if path.suffix == ".whl":
            name, version, _, tags = parse_wheel_filename(path.name)
            wheels.setdefault((name, str(version)), []).append((path, tags))
    problems = []
    for entry in (e for e in read_lock(lock) if applies(e, environment)):
        found = wheels.get((entry.name, str(Version(entry.version))), [])
        usable = [path for path, tags in found if tags & supported]
        if not found:
            problems.append(f"{entry.pin}: no wheel")
        elif not usable:
            problems.append(f"{entry.pin}: only wheels for other platforms ({', '.join(p.name for p, _ in found)})")
        elif not any(sha256(p) in entry.hashes for p in usable):
            problems.append(f"{entry.pin}: {', '.join(p.name for p in usable)} has a hash the lock does not list")
    return problems


def cmd_check(lock: Path, wheelhouse: Path, target: tuple[str, str] | None = None) -> None:
    problems = check(lock, wheelhouse, target)
    where = f"this platform ({platform.machine()})" if target is None else f"linux {target[0]}, CPython {target[1]}"
    if problems:
        raise WheelhouseError(
            f"{wheelhouse} cannot install {lock.name} on {where}: "
            + "; ".join(problems)
            + f". Make it on a connected machine with: python3 docker/wheelhouse.py download {lock.name} "
            "wheelhouse/<name> --platform <aarch64|x86_64>"
        )
    print(f"wheelhouse: {wheelhouse} has every wheel {lock.name} needs on {where}")


def cmd_install(lock: Path) -> None:
    name = os.environ.get("WHEELHOUSE", "").strip()
    command = [sys.executable, "-m", "pip", "install", *PIP_FLAGS]
    if name:
        folder = MOUNT / name
        if not folder.is_dir():
            available = sorted(p.name for p in MOUNT.iterdir() if p.is_dir()) if MOUNT.is_dir() else []
            raise WheelhouseError(
                f"WHEELHOUSE={name}: no folder wheelhouse/{name} in the build context "
                f"(folders there: {', '.join(available) or 'none'})"
            )
        cmd_check(lock, folder)
        command += ["--no-index", "--find-links", str(folder)]
    print("wheelhouse: " + " ".join([*command, "-r", str(lock)]), flush=True)
    os.execv(sys.executable, [*command, "-r", str(lock)])


def cmd_install_pinned(pin: str, expected: str) -> None:
    name, sep, version = pin.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise WheelhouseError(f"{pin!r} is not name==version")
    folder_name = os.environ.get("WHEELHOUSE", "").strip()
    if not folder_name:
        raise WheelhouseError(
            f"{pin} is on no public index: build offline with WHEELHOUSE=<folder> and put its wheel in "
            "wheelhouse/<folder>/ (docs/environment.md)"
        )
    folder = MOUNT / folder_name
    wanted = (canonicalize_name(name), Version(version))
    found = []
    if folder.is_dir():
        for path in sorted(folder.glob("*.whl")):
            wheel_name, wheel_version, _, tags = parse_wheel_filename(path.name)
            if (wheel_name, wheel_version) == wanted and tags & set(sys_tags()):
                found.append(path)
    if len(found) != 1:
        what = "no wheel" if not found else f"{len(found)} wheels ({', '.join(p.name for p in found)})"
        raise WheelhouseError(
            f"{pin}: {what} for this platform ({platform.machine()}, CPython "
            f"{'.'.join(platform.python_version_tuple()[:2])}) in wheelhouse/{folder_name}; put exactly one there"
        )
    wheel = found[0]
    actual = sha256(wheel)
    expected = expected.strip().lower()
    if not expected:
        raise WheelhouseError(
            f"{wheel.name} is in wheelhouse/{folder_name}, but no sha256 is pinned for it: check where the wheel "
            f"came from, then pass its hash as the build argument (sha256sum wheelhouse/{folder_name}/{wheel.name}; "
            f"this file's is {actual})"
        )
    if actual != expected:
        raise WheelhouseError(
            f"{wheel.name} has sha256 {actual}, but the pinned value is {expected}: the wheel is not the one that was "
            "pinned; replace it with the pinned wheel, or pin this one only after checking where it came from"
        )
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"{name.strip()}=={version.strip()} --hash=sha256:{expected}\n")
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        *PIP_FLAGS,
        "--no-index",
        "--find-links",
        str(folder),
        "-r",
        f.name,
    ]
    print(f"wheelhouse: {wheel.name} sha256 {actual} matches the pinned value; " + " ".join(command), flush=True)
    os.execv(sys.executable, command)


def cmd_download(lock: Path, out: Path, machine: str, python: str) -> None:
    environment = target_environment(machine, python)
    entries = [e for e in read_lock(lock) if applies(e, environment)]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for entry in entries:
            f.write(entry.pin + " " + " ".join(f"--hash=sha256:{h}" for h in sorted(entry.hashes)) + "\n")
    major_minor = environment["python_version"]
    abi = "cp" + major_minor.replace(".", "")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        *(f"--platform={tag}" for tag in platform_tags(machine)),
        "--python-version",
        major_minor,
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--abi",
        "abi3",
        "--abi",
        "none",
        "-d",
        str(out),
        "-r",
        f.name,
    ]
    print(f"wheelhouse: {len(entries)} packages of {lock.name} for linux {machine}, CPython {python} -> {out}")
    try:
        subprocess.run(command, check=True)
    except subprocess.CalledProcessError as e:
        raise WheelhouseError(f"pip download failed (exit {e.returncode}); see pip's message above") from None
    finally:
        os.unlink(f.name)
    print(f"wheelhouse: {out} is complete for {lock.name} (linux {machine}, CPython {major_minor})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    d = sub.add_parser("download", help="make a wheelhouse for LOCK and a target platform")
    d.add_argument("lock", type=Path)
    d.add_argument("out", type=Path)
    d.add_argument("--platform", choices=MACHINES, default=platform.machine(), help="target machine")
    d.add_argument("--python", default="3.11.14", help="target CPython version (markers and wheel tags)")
    c = sub.add_parser(
        "check",
        help="does WHEELHOUSE hold every wheel LOCK needs on this machine, or with "
        "--platform on the image's (run it before a build)?",
    )
    c.add_argument("lock", type=Path)
    c.add_argument("wheelhouse", type=Path)
    c.add_argument("--platform", choices=MACHINES, default=None, help="the image's machine (default: this one's tags)")
    c.add_argument("--python", default="3.11.14", help="the image's CPython version, with --platform")
    i = sub.add_parser("install", help="pip install LOCK (from /wheelhouse/$WHEELHOUSE when set)")
    i.add_argument("lock", type=Path)
    p = sub.add_parser(
        "install-pinned",
        help="pip install one wheel from /wheelhouse/$WHEELHOUSE whose sha256 "
        "equals --sha256 (a wheel no public index carries)",
    )
    p.add_argument("pin", help="name==version")
    p.add_argument("--sha256", default="", help="the wheel's sha256, pinned by the user (a build argument)")
    ns = parser.parse_args(argv)
    if ns.verb == "install-pinned":
        cmd_install_pinned(ns.pin, ns.sha256)
        return
    if not ns.lock.is_file():
        raise WheelhouseError(f"{ns.lock}: no such lock file")
    if ns.verb == "download":
        cmd_download(ns.lock, ns.out, ns.platform, ns.python)
    elif ns.verb == "check":
        cmd_check(ns.lock, ns.wheelhouse, None if ns.platform is None else (ns.platform, ns.python))
    else:
        cmd_install(ns.lock)


if __name__ == "__main__":
    main()
