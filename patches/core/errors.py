"""The one exception a patch raises when it cannot do its job."""

from __future__ import annotations


class PatchError(RuntimeError):
    """An enabled patch cannot apply (or found its target misused); the run must stop.

    The message always names the patch, says what is wrong with the values found, and ends with the fix.

    Attributes:
        patch: registry name of the patch, e.g. ``deltanet_routing``.
        problem: what is wrong, with the values found (versions, devices, ranges).
        fix: what to do about it.
    """

    def __init__(self, patch: str, problem: str, fix: str) -> None:
        self.patch = patch
        self.problem = problem
        self.fix = fix
        super().__init__(f"patch {patch}: {problem}. Fix: {fix}")
