"""The machinery of the ``packed_rows`` patch, one module per concern: the samples of a packed row read off its
mask or its sample numbers, and the mask built from those numbers (``masks``); a Gated DeltaNet layer run one sample
at a time (``deltanet``); the varlen attention kernels of packed rows (``varlen``); the checks and the padding cut of
a packed batch (``batches``). The patch itself (its options, the wrappers, the proof, ``apply``) is
``patches/packed_rows.py``.

May import ``patches.core`` and ``patches.kernels`` (and, lazily, torch, transformers and LLaMA-Factory); never a
patch. Nothing is re-exported here.
"""
