"""Wrap a method of an upstream class once, and unwrap it again: the idiom of the class-level patches.

A wrapper carries ``__deltanet_launcher_patch__`` (the patch's name) and ``__deltanet_launcher_original__``
(what it wrapped). ``wrap_once`` does nothing when the outermost callable already is this patch's wrapper,
so applying twice is a no-op; ``unwrap`` restores the original only when this patch's wrapper is the
outermost one (two patches may wrap the same method, in registry order).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

MARKER = "__deltanet_launcher_patch__"
ORIGINAL = "__deltanet_launcher_original__"


def wrap_once(cls: type, attr: str, patch: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``cls.attr`` by ``make(current)`` unless it is already ``patch``'s wrapper."""
    current = getattr(cls, attr)
    if getattr(current, MARKER, None) == patch:
        return
    wrapper = make(current)
    setattr(wrapper, ORIGINAL, current)
    setattr(wrapper, MARKER, patch)
    setattr(cls, attr, wrapper)


def unwrap(module_name: str, class_name: str, attr: str, patch: str) -> None:
    """Put back what ``patch`` wrapped, if the module is loaded and its wrapper is the outermost."""
    module = sys.modules.get(module_name)
    cls = getattr(module, class_name, None) if module is not None else None
    current = getattr(cls, attr, None) if cls is not None else None
    if current is not None and getattr(current, MARKER, None) == patch:
        setattr(cls, attr, getattr(current, ORIGINAL))


def original_of(func: Callable) -> Callable:
    """The upstream callable under a wrapper of ours (the callable itself when it is not wrapped)."""
    return getattr(func, ORIGINAL, func)
