"""Launcher for LoRA fine-tuning of hybrid Gated-DeltaNet models with LLaMA-Factory.

Layout (docs/architecture.md has the whole picture), lowest layer first:

- ``errors``, ``files``: the base every other part may use;
- ``state/``, ``config/``: run states, the typed run record and its one writer, reconcile, trainer log, checkpoints,
  process identity (``state.procs``); the backends (``config.backend``) and the run config's schema and loading;
- ``data/``, ``results/``: data tools and the tiny demo model (``data.demo``); verify, report, curves, the adapter
  reader;
- ``checks/``, ``monitor/``: the rules about a run config (``checks.config_rules``), preflight and kernel checks;
  status, list and logs;
- ``run/``: setup, run directory, lock, supervisor, job, stop and resume;
- ``cli/``: the verb registry and every argparse line; ``entry``: what each training rank runs.
"""

from pathlib import Path

__version__ = "0.1.0"
# The source tree: every child process (the job, the kernel check, a detached supervisor) imports from here.
SOURCE_ROOT = Path(__file__).resolve().parent.parent
