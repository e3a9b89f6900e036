"""Validate the ``launcher.patches`` section: every problem reported at once, each with its fix.

Accepted forms per patch: ``name: true|false``, or ``name: {enabled: ..., <option>: ...}`` (a mapping
without ``enabled`` means enabled). Patches not mentioned get their defaults: enabled, except a patch whose
``Options.enabled`` defaults to false (``pad_lengths``). The result has
every registered patch, in registry order, as ``{"enabled": bool, <option>: value, ...}``; it is itself a
valid input, so normalizing twice changes nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from pydantic import ValidationError

WHERE = "launcher.patches"


def _option_problems(name: str, error: ValidationError, fields: list[str]) -> list[str]:
    problems = []
    for item in error.errors():
        path = ".".join([WHERE, name, *map(str, item["loc"])])
        value = item.get("input")
        if item["type"] == "extra_forbidden":
            problems.append(
                f"{path}: unknown option for patch {name}; its options are {', '.join(fields)} "
                "(remove the key or fix its spelling)"
            )
        elif item["type"] == "literal_error":
            problems.append(f"{path} is {value!r}; expected one of {item['ctx']['expected']}")
        elif item["type"] == "bool_type":
            problems.append(f"{path} is {value!r}; expected true or false")
        else:
            problems.append(f"{path} is {value!r}: {item['msg']}")
    return problems


def _settings_error(problems: list[str]) -> ValueError:
    return ValueError(f"{len(problems)} problem(s) in {WHERE}:\n" + "\n".join(f"- {p}" for p in problems))


def normalize_settings(raw: Mapping[str, Any] | None, patches: Mapping[str, ModuleType]) -> dict[str, dict[str, Any]]:
    """Turn the ``launcher.patches`` mapping into name -> full options for every patch in ``patches``
    (the registry's, in its order).

    Raises:
        ValueError: listing every problem (unknown patch, unknown option, bad value), one per line.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problem = (
            f"{WHERE} is {raw!r}; expected a mapping of patch name to true/false or options, "
            f"for example {{{next(iter(patches))}: true}}"
        )
        raise _settings_error([problem])
    problems: list[str] = []
    for key in raw:
        if key not in patches:
            close = difflib.get_close_matches(str(key), list(patches), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{WHERE}.{key}: unknown patch{hint}; known patches: {', '.join(patches)}")
    normalized: dict[str, dict[str, Any]] = {}
    for name, module in patches.items():
        value = raw.get(name, {})  # not named: the patch's defaults (enabled, unless its Options say not)
        fields = list(module.Options.model_fields)
        if isinstance(value, bool):
            value = {"enabled": value}
        elif isinstance(value, Mapping) and "enabled" not in value and name in raw:
            value = {**value, "enabled": True}
        elif not isinstance(value, Mapping):
            problems.append(f"{WHERE}.{name} is {value!r}; expected true, false, or a mapping with {', '.join(fields)}")
            continue
        try:
            normalized[name] = module.Options.model_validate(dict(value)).model_dump()
        except ValidationError as error:
            problems.extend(_option_problems(name, error, fields))
    if problems:
        raise _settings_error(problems)
    return normalized
