"""Running a training job: the run config, setup checks, the run directory, the run lock, the
supervisor and the job it starts, stop and resume, and why a job failed.

May import ``state``, ``checks``, ``results``, ``data`` and the base modules; never ``cli``. The
training stack (torch, LLaMA-Factory) is imported only inside functions that need it.
"""
