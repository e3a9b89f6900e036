"""Wrap a method of an upstream class once, and unwrap it again: the idiom of the class-level patches.

A wrapper carries ``__deltanet_launcher_patch__`` (the patch's name) and ``__deltanet_launcher_original__``
(what it wrapped), and the wrapped callable's name, docstring and signature (``functools.update_wrapper``:
``generate()`` reads the forward's signature to decide what to pass). ``wrap_once`` does nothing when this
patch's wrapper is anywhere in the chain, so applying twice is a no-op; ``unwrap`` restores the original only
when this patch's wrapper is the outermost one (two patches may wrap the same method, in registry order).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

MARKER = "__deltanet_launcher_patch__"
ORIGINAL = "__deltanet_launcher_original__"


def _chain(func: Callable):
    while func is not None:
        yield func
        func = getattr(func, ORIGINAL, None)


def wrap_once(cls: type, attr: str, patch: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``cls.attr`` by ``make(current)`` unless ``patch``'s wrapper is already in its chain."""
    current = getattr(cls, attr)
    if any(getattr(f, MARKER, None) == patch for f in _chain(current)):
        return
    wrapper = functools.update_wrapper(make(current), current)
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
    """The upstream callable under every wrapper of ours (the callable itself when it is not wrapped)."""
    return list(_chain(func))[-1]
