"""What is wrong with one run config: the one entry for the rules about a config (``check_run_config``).

Every caller asks here: ``launcher check`` (every finding, the memory forecast included), and through
``launcher.run.setup.prepare`` ``launcher preflight``, ``launcher run`` and the supervisor before it starts a run.
``launcher.run.config.read_run_config`` applies ``file_problems`` while it reads a config, so a config that
breaks them never loads.

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

from launcher import backend as backends
from launcher.checks.config_check import ERROR, OK, SKIPPED, WARN, Finding, Findings, check_llamafactory
from launcher.checks.data_check import check_output
from launcher.checks.memory import check_memory
from launcher.checks.patch_check import patch_problems
from launcher.state.runs import OUTPUT_SUBDIR
from patches.versions import installed_version

if TYPE_CHECKING:
    from launcher.run.config import RunConfig

FORMAL_MIN_CUTOFF = 4096


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
        out.items.append(memory_finding(config, device_gib))
    return out


def _check_output_root(config: RunConfig, out: Findings, elsewhere: bool) -> None:
    root = Path(config.launcher.output_root)
    if elsewhere and not root.exists():  # this machine's disk says nothing of the run machine's
        out.not_here("launcher.output_root", f"{root} is not on this machine", "", elsewhere)
        return
    _, status, detail = check_output(root, config.launcher.smoke)
    out.add("launcher.output_root", ERROR if status == "fail" else OK, f"launcher.output_root: {detail}")


def memory_finding(config: RunConfig, device_gib: float | None) -> Finding:
    """The memory forecast as a ``launcher check`` finding (``launcher.checks.memory``): an error when the run
    will not fit, a warning when it is tight or cannot be forecast."""
    # `auto` names no device to read here (preflight resolves it on the server): the forecast without a verdict,
    # unless --device-memory gives one
    status, detail = check_memory(config, config.llamafactory, config.launcher.backend, device_gib)
    return Finding("memory", {"fail": ERROR, "warn": WARN}.get(status, OK), f"memory: {detail}")


def file_problems(config: RunConfig, *, require_model: bool = True) -> list[str]:
    """The rules a config must pass to load (``read_run_config`` applies them), each problem naming its key.

    Args:
        require_model: Whether ``model_name_or_path`` must be a folder here (``launcher check --no-model``
            checks a config on a machine that does not hold the model).
    """
    problems = []
    data, launcher = config.llamafactory, config.launcher
    cutoff = data.get("cutoff_len", 2048)  # LLaMA-Factory's default
    if not launcher.smoke and isinstance(cutoff, int) and cutoff < FORMAL_MIN_CUTOFF:
        problems.append(
            f"cutoff_len: {cutoff} is below {FORMAL_MIN_CUTOFF}; a formal run must see whole counselling "
            f"dialogues (set cutoff_len: {FORMAL_MIN_CUTOFF} or more, or mark a short test run with "
            "launcher.smoke: true)"
        )
    if launcher.early_stopping is not None:
        eval_s, save_s = str(data.get("eval_strategy", "no")), str(data.get("save_strategy", "steps"))
        if eval_s == "no" or eval_s != save_s:
            problems.append(
                f"launcher.early_stopping: needs evaluations and checkpoints on the same schedule (eval_strategy is "
                f"{eval_s!r}, save_strategy {save_s!r}); set both to steps"
            )
        elif eval_s == "steps" and int(data.get("save_steps", 500)) % int(data.get("eval_steps") or 500):
            problems.append(
                f"launcher.early_stopping: save_steps {data.get('save_steps')} is not a multiple of eval_steps "
                f"{data.get('eval_steps')}; the best evaluation must have a checkpoint (e.g. equal values)"
            )
    model = data.get("model_name_or_path")
    if model is None:
        problems.append("model_name_or_path: missing; set it to the model folder (config.json and shards)")
    elif require_model and not Path(str(model)).is_dir():
        problems.append(
            f"model_name_or_path: {model!r} is not a folder here; models are not downloaded, so point it "
            "at a local model folder (for the demo: `launcher demo-assets` builds demo/model)"
        )
    if launcher.stall_action == "restart" and launcher.restart is None:
        problems.append(
            "launcher.stall_action: 'restart' needs automatic recovery; add launcher.restart: "
            "{max_restarts: 3, backoff_s: 60} or use stall_action: stop"
        )
    return problems
