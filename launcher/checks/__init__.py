"""Checks made before training: preflight and each of its rows (packages against the lock, model
folder, datasets, output space), and the DeltaNet kernel checks (``validate-kernels``).

May import ``state``, ``results``, ``data`` and the base modules; the run config only for type
hints. Never ``run``, ``monitor`` or ``cli``.
"""
