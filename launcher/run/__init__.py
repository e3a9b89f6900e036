"""Running a training job: setup, the run directory, the run lock, the
supervisor and the job it starts, stop and resume, why a job failed, and the evaluation of its checkpoints
(``evaluate.py``, which starts ``launcher.rank.evaluate`` in a child process).

May import ``config``, ``state``, ``checks``, ``results``, ``data`` and the base modules; never ``cli``. The
training stack (torch, LLaMA-Factory) is imported only inside functions that need it.
"""
