"""A training entry for a CPU rank that stands in for a device reporting its memory: the real ``launcher.entry``
with a memory budget instead of the config's count, and a stand-in allocator counter.

    STANDIN_BUDGET_GIB=100 STANDIN_PEAK_GIB="1.0,0.0;1.0,100000" python -m tests.support.memory_standin_entry RUN_DIR

``launcher check`` refuses ``memory_budget_gib`` on the CPU (nothing reports a peak there), so the config asks for
``uncheckpointed_layers`` and this entry turns it into ``memory_budget_gib: STANDIN_BUDGET_GIB`` before the
patches apply. The counter holds 0.5 GiB and reports, after its N-th ``reset_peak_memory_stats``, the N-th peak of
this rank's list in ``STANDIN_PEAK_GIB`` (ranks separated by ``;``; the last value holds after the list ends).

``STANDIN_ROOM_LAYERS=R`` sets the budget instead from what the first step measured, so that the plan's room is R
times the count of the dearest measured layer (the tiny model's layers cost megabytes, so no budget in GiB given
beforehand leaves room for some of them and not all): budget = the all-checkpointed first-step peak (at the run's
longest sequence, as the plan projects it) + the margin + that room. Every plan of the run (the first, and the
corrections) is made against that one budget.
"""

from __future__ import annotations

import os
import sys

from launcher.rank import entry

GIB = 1024**3


class StandInCounter:
    def __init__(self, peaks_gib: list[float]) -> None:
        self.peaks = peaks_gib
        self.resets = 0

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1

    def memory_allocated(self) -> int:
        return int(0.5 * GIB)

    def max_memory_allocated(self) -> int:
        return int(self.peaks[min(max(self.resets, 1), len(self.peaks)) - 1] * GIB)


def _budget_from_room(module, room_layers: float) -> None:
    """Make every budget plan of ``module`` against one budget fixed at its first plan (see the docstring)."""
    from patches.planning.budget import MARGIN_GIB, PRIOR_FACTOR, length_scale

    plan, fixed = module.plan, {}

    def plan_with_room(costs, **kwargs):
        if kwargs.get("budget_gib") is None:
            return plan(costs, **kwargs)
        if not fixed:  # the first plan prices each layer at PRIOR_FACTOR times its count
            scale, held = length_scale(kwargs.get("seq_len"), kwargs.get("cutoff_len")), kwargs["held_gib"]
            dearest = max(c.saved_bytes for c in costs.values()) / PRIOR_FACTOR / GIB
            all_checkpointed = held + (kwargs["peak_gib"] - held) * scale
            fixed["budget"] = all_checkpointed + MARGIN_GIB + room_layers * dearest * scale
            module._state["budget"] = fixed["budget"]
        return plan(costs, **{**kwargs, "budget_gib": fixed["budget"]})

    module.plan = plan_with_room


def main() -> int:
    import patches
    from patches import checkpoint_all_layers

    rank = int(os.environ.get("RANK", "0"))
    peaks = [float(x) for x in os.environ["STANDIN_PEAK_GIB"].split(";")[rank].split(",")]
    counter = StandInCounter(peaks)
    checkpoint_all_layers._memory = lambda backend: counter
    apply_enabled = patches.apply_enabled

    def with_a_budget(settings, **kwargs):
        budget = float(os.environ["STANDIN_BUDGET_GIB"])
        options = {**settings["checkpoint_all_layers"], "uncheckpointed_layers": None, "memory_budget_gib": budget}
        return apply_enabled({**settings, "checkpoint_all_layers": options}, **kwargs)

    patches.apply_enabled = with_a_budget
    if os.environ.get("STANDIN_ROOM_LAYERS"):
        _budget_from_room(checkpoint_all_layers, float(os.environ["STANDIN_ROOM_LAYERS"]))
    return entry.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
