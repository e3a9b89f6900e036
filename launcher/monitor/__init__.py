"""Host-side views of runs: ``status``, ``list`` and ``logs``, read from the run directory without the
lock or torch. May import ``state``, the base modules and ``run.placement`` (where each run lives: its liveness
and what status shows of it); nothing that imports the config's schema or the training stack.
"""
