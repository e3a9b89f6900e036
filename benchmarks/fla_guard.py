"""Lift FLA's Hopper guard in a *measuring* process only, then run a ``launcher`` verb in that process.

    python -m benchmarks.fla_guard validate-kernels --device cuda --json kernels.json

fla-core 0.6.0 refuses the gated-delta-rule backward on Hopper GPUs with 3.4.0 <= Triton < 3.7.1 (FLA issue
#640; the guard in ``fla/ops/common/chunk_o.py`` reads the module flag ``TRITON_ABOVE_3_7_1`` at call time).
The measuring H200 has Triton 3.6.0 and no newer one could be installed, so measurements there set that flag in the
measuring process, and the same process checks the kernel against the fp32 reference
(``launcher validate-kernels`` here, the 27B-shape case in ``bench_entry``), so the numbers come with the
evidence that the gradients are right on that machine. Product code never does this: ``patches`` and
``launcher`` only read the flags (``patches.kernels.fla_probe``), and the CUDA image pins a Triton FLA accepts.
"""

from __future__ import annotations

import sys
from typing import Any

FLAG_MODULE, FLAG = "fla.ops.common.chunk_o", "TRITON_ABOVE_3_7_1"


def lift_hopper_guard() -> dict[str, Any]:
    """Set ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` if FLA is importable; return what was done."""
    import importlib

    try:
        module = importlib.import_module(FLAG_MODULE)
    except ImportError as err:
        return {"lifted": False, "reason": f"FLA not importable: {err}"}
    flags = {name: getattr(module, name, None) for name in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", FLAG)}
    if flags[FLAG] is None:
        return {"lifted": False, "reason": f"{FLAG_MODULE} has no {FLAG} (not fla-core 0.6.x)", "flags": flags}
    would_refuse = bool(flags["IS_NVIDIA_HOPPER"] and flags["TRITON_ABOVE_3_4_0"] and not flags[FLAG])
    setattr(module, FLAG, True)
    note = "set to True in this measuring process only" if would_refuse else "the guard would not fire here"
    return {"lifted": would_refuse, "flag": f"{FLAG_MODULE}.{FLAG}", "flags_before": flags, "note": note}


def main(argv: list[str] | None = None) -> int:
    guard = lift_hopper_guard()
    print(f"fla_guard: {guard}", file=sys.stderr, flush=True)
    from launcher.cli import main as launcher_main

    return launcher_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
