"""Checks a patch runs before it touches anything: package versions and the upstream symbols it needs.

Versions are compared with ``packaging`` (never as strings). Symbol checks import the upstream module and
look for the names the patch reads or replaces; ``require_global_loads`` goes one step further and checks
that an upstream function still reads a name from its module globals at call time, which is what makes
replacing that global effective.
"""

from __future__ import annotations

import dis
import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import PatchError


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _turn_off_hint(patch: str, dist: str, found: str) -> str:
    return (
        f"or turn the patch off with `launcher.patches.{patch}: false` after checking in "
        f"patches/{patch}.py whether {dist} {found} still needs it"
    )


def check_versions(patch: str, supported: Mapping[str, SpecifierSet]) -> dict[str, str]:
    """Check every distribution in ``supported`` against its range.

    Returns:
        The versions found, by distribution name.

    Raises:
        PatchError: a distribution is missing, has an unparsable version, or is outside its range.
    """
    found: dict[str, str] = {}
    for dist, spec in supported.items():
        version = installed_version(dist)
        if version is None:
            raise PatchError(
                patch,
                f"{dist} is not installed; the patch supports {dist}{spec}",
                f"pip install '{dist}{spec}'",
            )
        try:
            parsed = Version(version)
        except InvalidVersion:
            raise PatchError(
                patch,
                f"{dist} reports version {version!r}, which is not a valid version; expected {dist}{spec}",
                f"reinstall {dist} from a release: pip install '{dist}{spec}'",
            ) from None
        if not spec.contains(parsed, prereleases=True):
            raise PatchError(
                patch,
                f"{dist} {version} is installed; this patch supports {dist}{spec}",
                f"install a supported version (pip install '{dist}{spec}') " + _turn_off_hint(patch, dist, version),
            )
        found[dist] = version
    return found


def require_symbols(patch: str, module_name: str, names: Iterable[str], dist: str) -> object:
    """Import ``module_name`` and check it defines every name in ``names`` (a value of None counts).

    Returns:
        The imported module.

    Raises:
        PatchError: the module does not import or lacks a name.
    """
    version = installed_version(dist) or "not installed"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an upstream import can fail with anything, not only ImportError
        raise PatchError(
            patch,
            f"cannot import {module_name} ({dist} {version}): {type(exc).__name__}: {exc}",
            f"install the {dist} version this patch supports (see patches/{patch}.py)",
        ) from exc
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise PatchError(
            patch,
            f"{module_name} ({dist} {version}) has no {', '.join(missing)}; the upstream code this patch "
            "targets has changed",
            f"install the {dist} version this patch supports, or update patches/{patch}.py to the new code",
        )
    return module


def require_global_loads(patch: str, func: Callable, names: Iterable[str], dist: str) -> None:
    """Check that ``func`` reads every name in ``names`` from its module globals when it runs.

    Raises:
        PatchError: a name is no longer read as a global, so replacing it would silently do nothing.
    """
    loaded = {ins.argval for ins in dis.get_instructions(func) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    missing = [name for name in names if name not in loaded]
    if missing:
        version = installed_version(dist) or "not installed"
        raise PatchError(
            patch,
            f"{func.__module__}.{func.__qualname__} ({dist} {version}) no longer reads {', '.join(missing)} "
            "from its module globals, so replacing them would have no effect",
            f"install the {dist} version this patch supports, or update patches/{patch}.py to the new code",
        )
