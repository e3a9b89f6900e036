"""The kernel machinery the patches bind: what FLA can do here (``fla_probe``), the fused glue kernels and their
adapters (``fused_kernels``), the AscendC gated-delta-rule kernels behind FLA's call contract (``ascendc_gdn``)
and the stand-in that records the first call of a DeltaNet kernel (``recorder``).

May import ``patches.core`` only (and, lazily, torch and the kernels' packages); never a patch or ``planning``.
Nothing is re-exported here.
"""
