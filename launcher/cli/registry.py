"""The verb record and the argument helpers every verb module shares."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launcher.errors import LauncherError
from launcher.files import read_yaml_mapping
from launcher.state.runs import DEFAULT_RUNS_ROOT, ROOT_ENV, default_root, run_dir_for


@dataclass(frozen=True)
class Verb:
    """One ``launcher`` verb: its help, examples, argparse lines and what it runs.

    ``run`` returns the exit code; a ``LauncherError`` it raises is printed once by ``main``. ``supervises``: the
    verb supervises a run in this process, so ``main`` holds the stop signals before anything else is loaded
    (``run/signals.py``).
    """

    name: str
    help: str
    examples: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    hidden: bool = False
    supervises: bool = False


def add_root_arg(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--root", type=Path, default=None, help=f"runs folder (default: ${ROOT_ENV}, else outputs/runs)")
    where.add_argument(
        "--config",
        dest="root_config",
        type=Path,
        default=None,
        metavar="CONFIG",
        help="find runs under this run config's launcher.output_root",
    )


def add_run_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run id or run directory (default: the newest run under --root)")
    add_root_arg(p)


OVERRIDES_HELP = (
    "KEY=VALUE after the config overrides a key, as with llamafactory-cli (learning_rate=1.0e-4, "
    "launcher.nproc_per_node=2); a run records them in overrides.yaml"
)


def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="run config: LLaMA-Factory YAML plus a launcher: section")
    p.usage = f"launcher {p.prog.split()[-1]} CONFIG [KEY=VALUE ...] [options]"
    p.description = f"{p.description or ''}\n\n{OVERRIDES_HELP}".strip()


def overrides_of(ns: argparse.Namespace) -> dict[str, Any]:
    """The KEY=VALUE overrides given after the config; raises ``ConfigError`` for a malformed one."""
    from launcher.config.run_config import parse_overrides

    return parse_overrides(list(getattr(ns, "overrides", None) or []))


def runs_root(ns: argparse.Namespace) -> Path:
    """The runs folder: ``--root``, else ``--config``'s ``launcher.output_root``, else ``$LAUNCHER_ROOT`` or
    outputs/runs. The config is read for that one key only (no validation, no pydantic: host verbs stay fast).
    """
    if ns.root is not None:
        return ns.root
    if ns.root_config is not None:
        data = read_yaml_mapping(ns.root_config)
        if isinstance(data, str):
            raise LauncherError(f"--config: {data}")
        section = data.get("launcher") if isinstance(data.get("launcher"), dict) else {}
        return Path(str(section.get("output_root", DEFAULT_RUNS_ROOT)))
    return default_root()


def _when(epoch: float | None) -> str:
    """An engine's start time, as the lock's owner file writes its own (UTC, seconds)."""
    if epoch is None:
        return "at an unknown time"
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


SETUP_WAIT_S = 600.0  # a run being set up (its config checked) gets its folder within this; then the newest run


def run_dir(ns: argparse.Namespace) -> Path:
    """The run directory RUN names, or the newest under the runs folder; raises ``RunNotFound``.

    Without RUN, while a run is being set up under the runs folder, the newest folder is the previous run: this
    waits for the new run's folder instead, and says so on stderr. Being set up: a container the Docker engine
    runs `launcher run` in, mounting the runs folder, that has not recorded its run yet (right after
    ``docker compose up -d``, before its launcher holds the lock: ``launcher.state.starting``), or a supervisor
    holding the lock and checking the config (40 to 100 s after ``docker compose up -d`` on a busy machine).
    """
    root = runs_root(ns)
    if ns.run is None:
        from launcher.run.lock import being_set_up, wait_for_run_id
        from launcher.state.starting import starting_container, wait_for_container

        owner = being_set_up(root)
        said = False
        if owner is None and (starting := starting_container(root)) is not None:
            print(
                f"waiting for the run being set up under {root} (container {starting.name}, started "
                f"{_when(starting.started)}): its folder appears once its config is checked",
                file=sys.stderr,
                flush=True,
            )
            said = True
            found = wait_for_container(root, starting, lambda: being_set_up(root) is not None)
            if found is not None:
                return found.resolve()
            owner = being_set_up(root)
            if owner is None:
                print("warning: no run folder came of it; showing the newest run", file=sys.stderr, flush=True)
        if owner is not None:
            if not said:
                print(
                    f"waiting for the run being set up under {root} (supervisor pid {owner.get('pid')} on "
                    f"{owner.get('hostname')}, since {owner.get('since')}): its folder appears once its config is "
                    f"checked",
                    file=sys.stderr,
                    flush=True,
                )
            run_id = wait_for_run_id(root, SETUP_WAIT_S)
            if run_id is not None:
                return run_dir_for(run_id, root)
            print("warning: no run folder came of it; showing the newest run", file=sys.stderr, flush=True)
    return run_dir_for(ns.run, root)
