"""Where a run lives, chosen once: a local process, a container seen from the host, a Slurm job.

The interface is ``base.Placement`` (start, reconcile, stop with the one grace rule, resume, status fields, where,
lost node); each placement is one module: ``local.py``, ``container.py``, ``slurm.py``. ``placement_of`` picks the
first that holds a record, in ``PLACEMENTS``' order; a new placement (Kubernetes, say) is one new module, its
entry in ``PLACEMENTS`` and its tests (docs/architecture.md).

May import ``config``, ``state`` and the base modules, and ``run``'s resume plan, lock, run directory and signals;
never the supervisor (which asks its placement about earlier runs and lost nodes).
"""

from __future__ import annotations

from pathlib import Path

from launcher.run.placement.base import Placement
from launcher.run.placement.container import ContainerPlacement
from launcher.run.placement.local import LocalPlacement
from launcher.run.placement.slurm import SlurmPlacement
from launcher.state.reconcile import Reconciled
from launcher.state.record import RunRecord

# the first that holds a record is its placement; LocalPlacement holds every record, so it comes last
PLACEMENTS: tuple[type[Placement], ...] = (SlurmPlacement, ContainerPlacement, LocalPlacement)


def placement_of(record: RunRecord) -> Placement:
    """Where ``record``'s run lives, as seen from here."""
    return next(kind for kind in PLACEMENTS if kind.holds(record))(record)


def reconcile(record: RunRecord, run_dir: Path) -> Reconciled:
    """``record`` (read from ``run_dir``) held against the live system, by its placement."""
    return placement_of(record).reconcile(run_dir)
