"""Checks made before training: every rule about a run config through one entry
(``config_rules.check_run_config``; the LLaMA-Factory part in ``config_check``, patch options in ``patch_check``),
preflight and each of its rows (packages against the lock, model folder, datasets, output space), and the
DeltaNet kernel checks (``kernels/``: ``validate-kernels``, preflight's kernel child and kernel choice).

May import ``config`` (the run config and the rules it loads by), ``state``, ``results``, ``data`` and the base
modules. Never ``run``, ``monitor`` or ``cli``.
"""
