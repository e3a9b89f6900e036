"""Host-side views of runs: ``status``, ``list`` and ``logs``, read from the run directory without the
lock or torch. May import ``state`` and the base modules only.
"""
