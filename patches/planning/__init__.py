"""Measuring and planning memory for ``checkpoint_all_layers`` and the FSDP2 patches: the layer plan from measured
costs (``budget``), how the layers are checkpointed (``census``), what one layer keeps for backward (``meter``),
one plan on every rank (``ranks``), what each rank holds after FSDP2 sharded the model (``shards``), and the
checkpointed layers' inputs kept in host memory instead (``offload``).

May import ``patches.core`` only (and, lazily, torch); never a patch or ``kernels``. Nothing is re-exported here.
"""
