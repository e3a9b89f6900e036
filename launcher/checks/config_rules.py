"""What is wrong with one run config: the one entry for the rules about a config (``check_run_config``).

Every caller asks here: ``launcher check`` (every finding, the memory forecast included), and through
``launcher.run.setup.prepare`` ``launcher preflight``, ``launcher run`` and the supervisor before it starts a run.
``launcher.config.run_config.read_run_config`` applies ``file_problems`` (``launcher.config.run_config``) while it
reads a config, so a config that breaks them never loads.

The rules, each finding naming its key and, for a problem, the fix:

- the file alone (``file_problems``): the formal ``cutoff_len`` floor (not for ``launcher.smoke``), early
  stopping's schedule of evaluations and checkpoints, the model folder, ``stall_action: restart`` without
  ``launcher.restart``;
- the devices against ``launcher.nproc_per_node``;
- patch options against the LLaMA-Factory keys (``launcher.checks.patch_check``);
- the LLaMA-Factory part (``launcher.checks.config_check``);
- the output root's space (``launcher.checks.data_check``);
- the memory forecast (``launcher.checks.memory``), for ``launcher check``.

Preflight's rows (``launcher.checks.preflight``) check the machine the run trains on, once the config has passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from launcher.checks.config_check import ERROR, OK, SKIPPED, WARN, Finding, Findings, check_llamafactory
from launcher.checks.data_check import check_output
from launcher.checks.memory import check_memory
from launcher.checks.patch_check import patch_problems
from launcher.config import backend as backends
from launcher.state.runs import OUTPUT_SUBDIR
from patches.core.versions import installed_version

if TYPE_CHECKING:
    from launcher.config.run_config import RunConfig


def check_run_config(
    config: RunConfig,
    *,
    problems: list[str] | None = None,
    model: bool = True,
    devices: bool = True,
    output: bool = True,
    elsewhere: bool = False,
    memory: bool = False,
    device_gib: float | None = None,
) -> Findings:
    """Every check of a run config that needs no run: the launcher section (``problems`` from
    ``read_run_config``), the devices, the patch options, the LLaMA-Factory part (``checks.config_check``), the
    output root, and the memory forecast.

    Args:
        model: read the model's config.json (``launcher check --no-model`` does not).
        devices: count the backend's devices (``launcher check`` runs off the server and does not).
        output: check the output root's space (a run leaves that to preflight's ``output`` row, which
            ``LAUNCHER_PREFLIGHT_SKIP`` can skip; an unusable folder still stops the run when it is made).
        elsewhere: the config is meant for another machine (``launcher check --for-another-machine``): a
            path it names that is not here is a check not made (``SKIPPED``), not an error; what is here is
            checked as usual.
        memory: add the memory forecast (``memory_finding``), when the model is read and ``problems`` is empty.
        device_gib: the memory of one device for the forecast's verdict (``--device-memory``).
    """
    out = Findings()
    for problem in problems or []:
        out.add(problem.split(":", 1)[0], ERROR, problem)
    launcher = config.launcher
    if devices:
        try:
            backend = backends.resolve(launcher.backend)
        except ValueError as err:
            out.add("launcher.backend", ERROR, f"launcher.backend: {err}")
            backend = backends.BACKENDS["cpu"]
        if backend.name != "cpu":
            found = backends.device_count(backend.name)
            if found < launcher.nproc_per_node:
                out.add(
                    "launcher.nproc_per_node",
                    ERROR,
                    (
                        f"launcher.nproc_per_node: {launcher.nproc_per_node} processes but {found} {backend.name} "
                        f"device(s) visible (check {backend.visible_devices_env}, or lower launcher.nproc_per_node)"
                    ),
                )
        name = backend.name
    else:
        name = launcher.backend if launcher.backend != "auto" else "cpu"
        out.add(
            "devices",
            SKIPPED,
            f"devices: not counted here; `launcher preflight` checks the {launcher.backend} "
            f"backend's devices where the run will train",
        )
    placeholder = Path(launcher.output_root).resolve() / "validate" / OUTPUT_SUBDIR
    args = config.llamafactory_args(name, placeholder)
    torch_version = None if elsewhere else installed_version("torch")  # another machine's torch is not this one's
    # with launcher.patches unreadable (its problem is above) the settings are unknown: no rule on them
    if not any(problem.startswith("launcher.patches:") for problem in problems or []):
        for key, problem in patch_problems(
            config.patches, args, backend=name, distribution=launcher.distribution, torch_version=torch_version
        ):
            out.add(key, ERROR, problem)
    out.items.extend(check_llamafactory(args, model=model, devices=devices, elsewhere=elsewhere).items)
    if output:
        _check_output_root(config, out, elsewhere)
    if memory and model and not problems:
        out.items.append(memory_finding(config, device_gib, host=not elsewhere))
    return out


def _check_output_root(config: RunConfig, out: Findings, elsewhere: bool) -> None:
    root = Path(config.launcher.output_root)
    if elsewhere and not root.exists():  # this machine's disk says nothing of the run machine's
        out.not_here("launcher.output_root", f"{root} is not on this machine", "", elsewhere)
        return
    _, status, detail = check_output(root, config.launcher.smoke)
    out.add("launcher.output_root", ERROR if status == "fail" else OK, f"launcher.output_root: {detail}")


def memory_finding(config: RunConfig, device_gib: float | None, host: bool = True) -> Finding:
    """The memory forecast as a ``launcher check`` finding (``launcher.checks.memory``): an error when the run
    will not fit (or its offloaded inputs not in this host's free memory, ``host``), a warning when it is tight or
    cannot be forecast."""
    # `auto` names no device to read here (preflight resolves it on the server): the forecast without a verdict,
    # unless --device-memory gives one
    status, detail = check_memory(config, config.llamafactory, config.launcher.backend, device_gib, host=host)
    return Finding("memory", {"fail": ERROR, "warn": WARN}.get(status, OK), f"memory: {detail}")
