"""A training entry that serves the fused glue from a stand-in FLA on the CPU (a fake: no GPU or NPU here).

    python -m tests.support.fused_standin_entry RUN_DIR

The real ``launcher.entry``, with two things changed in this rank only: the stand-in ``fla`` package of
``tests.support.patch_fixtures`` (fla-core 0.6.0's contracts in plain torch) is written to ``RUN_DIR/stub_fla`` and put
first on ``sys.path``, and the ``fused_ops`` patch selects kernels as it would on CUDA, so the whole Trainer step runs
through the adapters the patch installs on an accelerator (``FlaConv``, the class-level norm and MLP
forwards). The DeltaNet chunk kernel stays transformers' torch one (the routing sees backend cpu).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    from patches import fused_ops
    from patches.kernels import fused_kernels
    from tests.support.patch_fixtures import write_stub_fla

    sys.path.insert(0, str(write_stub_fla(Path(sys.argv[1]).resolve() / "stub_fla", platform="cuda")))

    select = fused_kernels.select_kernels
    fused_ops.fla_usable = lambda backend: None
    fused_kernels.select_kernels = lambda backend, wanted, fla, npu: select(
        "cuda" if backend == "cpu" else backend, wanted, fla, npu
    )
    from launcher.rank import entry

    return entry.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
