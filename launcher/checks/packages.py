"""Read the hash-locked requirements files and compare them with what is installed.

``requirements.lock`` (NPU image) and ``requirements-cuda.lock`` (CUDA image) are written by
``uv pip compile --generate-hashes`` (the command is in each file's header and in docs/environment.md).
Their format is pip's requirements format: ``name==version ; marker \\`` followed by ``--hash`` lines and
``# via`` annotations. pip has no public parser for it and ``packaging`` parses one requirement at a time,
so the few lines of joining and splitting are done here; each requirement itself is parsed with
``packaging.requirements.Requirement`` and each marker evaluated with ``packaging.markers``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from launcher import SOURCE_ROOT as PROJECT_ROOT
from patches.core.versions import installed_version

LOCK_FILES = {"npu": "requirements.lock", "cuda": "requirements-cuda.lock", "cpu": "requirements-cpu.lock"}
# An image built from another lock of its backend names it (the Dockerfile's npu-cann9 target:
# requirements-npu-cann9.lock).
LOCK_ENV = "LAUNCHER_LOCK"


@dataclass(frozen=True)
class LockedPackage:
    name: str  # canonical name (PEP 503)
    version: str
    marker: str | None
    hashes: tuple[str, ...]
    via: tuple[str, ...] = field(default=())

    @property
    def direct(self) -> bool:
        """Pinned in the ``.in`` file itself rather than pulled in by another package."""
        return any(v.startswith("-r ") for v in self.via)

    def applies(self, environment: dict[str, str] | None = None) -> bool:
        """Whether this entry is installed on the given (default: the running) environment."""
        if not self.marker:
            return True
        return Requirement(f"{self.name}; {self.marker}").marker.evaluate(environment)  # type: ignore[union-attr]


def lock_path(backend: str, root: Path = PROJECT_ROOT) -> Path:
    """The lock file the image for ``backend`` was built from (``$LAUNCHER_LOCK`` when the image names one)."""
    return root / (os.environ.get(LOCK_ENV) or LOCK_FILES[backend])


def parse_lock(path: Path) -> list[LockedPackage]:
    """Parse a uv/pip-compile lock file with hashes.

    Raises:
        ValueError: naming the line of a requirement that is not pinned with ``==`` or cannot be parsed.
    """
    packages: list[LockedPackage] = []
    entry: tuple[Requirement, list[str], list[str]] | None = None
    in_via = False
    logical = ""
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if line.startswith("#"):
            text = line.lstrip("#").strip()
            if entry is not None and text.startswith("via"):
                in_via = True
                rest = text[3:].strip()
                if rest:
                    entry[2].append(rest)
            elif entry is not None and in_via and text:
                entry[2].append(text)
            continue
        if not line:
            continue
        logical += " " + line.rstrip("\\").strip()
        if line.endswith("\\"):
            continue
        parts = logical.split()
        logical = ""
        hashes = [p.split("=", 1)[1] for p in parts if p.startswith("--hash=")]
        spec = " ".join(p for p in parts if not p.startswith("--hash="))
        if not spec:  # a line of hashes only (continued entry)
            if entry is not None:
                entry[1].extend(hashes)
            continue
        if entry is not None:
            packages.append(_finish(entry))
        try:
            req = Requirement(spec)
        except InvalidRequirement as err:
            raise ValueError(f"{path}:{number}: cannot parse {spec!r}: {err}") from err
        pins = [s for s in req.specifier if s.operator == "=="]
        if len(pins) != 1:
            raise ValueError(f"{path}:{number}: {spec!r} is not pinned with == (regenerate the lock)")
        entry = (req, hashes, [])
        in_via = False
    if entry is not None:
        packages.append(_finish(entry))
    return packages


def _finish(entry: tuple[Requirement, list[str], list[str]]) -> LockedPackage:
    req, hashes, via = entry
    version = next(iter(req.specifier)).version
    marker = str(req.marker) if req.marker else None
    return LockedPackage(canonicalize_name(req.name), version, marker, tuple(hashes), tuple(via))


@dataclass
class LockComparison:
    """Installed versions against one lock file, split the way preflight reports them."""

    lock: Path
    checked: int = 0
    direct_mismatch: list[str] = field(default_factory=list)  # "torch 2.14.1 (lock 2.7.1)"
    direct_missing: list[str] = field(default_factory=list)
    other_mismatch: list[str] = field(default_factory=list)
    other_missing: list[str] = field(default_factory=list)


def compare_installed(packages: list[LockedPackage], lock: Path) -> LockComparison:
    """Compare every entry of ``packages`` that applies here with the installed distribution."""
    result = LockComparison(lock)
    for pkg in packages:
        if not pkg.applies():
            continue
        result.checked += 1
        have = installed_version(pkg.name)
        if have is None:
            (result.direct_missing if pkg.direct else result.other_missing).append(pkg.name)
        elif not _same_version(have, pkg.version):
            text = f"{pkg.name} {have} (lock {pkg.version})"
            (result.direct_mismatch if pkg.direct else result.other_mismatch).append(text)
    return result


def _same_version(installed: str, locked: str) -> bool:
    """``installed`` satisfies ``==locked`` under PEP 440 (so 2.7.1+cpu satisfies a lock of 2.7.1)."""
    try:
        return SpecifierSet(f"=={locked}").contains(Version(installed), prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return installed == locked
