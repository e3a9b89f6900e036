"""Verbs that start, stop and check runs: run, start, stop, resume, check, preflight (and the internal
verbs a detached supervisor and preflight's kernel check run as)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from launcher.cli.registry import Verb, add_config_arg, add_run_arg, overrides_of, run_dir
from launcher.errors import ExitCode, LauncherError
from launcher.state.states import EXIT_CODE_TABLE


def _args_run(p: argparse.ArgumentParser) -> None:
    add_config_arg(p)
    p.add_argument("--quiet", action="store_true", help="do not echo the job's output (it still goes to the log)")


def _cmd_run(ns: argparse.Namespace) -> int:
    from launcher.config.run_config import ConfigError, load_run_config
    from launcher.run.supervisor import supervise

    from_env = _env_overrides()
    if os.environ.get(RESUME_ENV, "").strip():
        if from_env:
            raise LauncherError(
                f"{OVERRIDES_ENV} (compose's TRAIN_OVERRIDES) and {RESUME_ENV} (RESUME_RUN) are both set: a resume "
                "continues the run with its own config and overrides; unset TRAIN_OVERRIDES to resume, or unset "
                "RESUME_RUN to start a new run with them"
            )
        return _resume_instead(ns)
    try:
        return supervise(load_run_config(ns.config, {**from_env, **overrides_of(ns)}), echo=not ns.quiet)
    except ConfigError as err:  # a key from the environment is not in the file: say where it was set
        raise err.naming(list(from_env), f"by {OVERRIDES_ENV}, compose's TRAIN_OVERRIDES") from None


RESUME_ENV, ADAPTER_ONLY_ENV = "LAUNCHER_RESUME", "LAUNCHER_RESUME_ADAPTER_ONLY"  # compose: RESUME_RUN, ...
OVERRIDES_ENV = "LAUNCHER_OVERRIDES"  # compose: TRAIN_OVERRIDES


def _env_overrides() -> dict[str, Any]:
    """``LAUNCHER_OVERRIDES="max_steps=40 launcher.stop_grace_s=30"`` (compose's TRAIN_OVERRIDES): KEY=VALUE items
    split as a shell would (quote a value with spaces), applied like those after the config; the command line's
    win. A run records them in overrides.yaml with the others."""
    from launcher.config.run_config import parse_overrides

    text = os.environ.get(OVERRIDES_ENV, "").strip()
    source = f"{OVERRIDES_ENV} (compose's TRAIN_OVERRIDES)"
    try:
        items = shlex.split(text)
    except ValueError as err:
        raise LauncherError(
            f"{source}={text!r}: {err}; give KEY=VALUE items separated by spaces, e.g. "
            'TRAIN_OVERRIDES="max_steps=40 launcher.stop_grace_s=30"'
        ) from None
    return parse_overrides(items, source) if items else {}


def _resume_instead(ns: argparse.Namespace) -> int:
    """``launcher run CONFIG`` with LAUNCHER_RESUME=RUN (compose's RESUME_RUN): resume that run in the
    foreground instead of starting a new one (a run id under the config's output root, or a run directory)."""
    from launcher.config.run_config import load_run_config
    from launcher.run.control import resume_run
    from launcher.state.runs import run_dir_for

    run, adapter_only = os.environ[RESUME_ENV].strip(), os.environ.get(ADAPTER_ONLY_ENV, "").strip()
    if adapter_only not in ("", "0", "1"):
        raise LauncherError(
            f"{ADAPTER_ONLY_ENV}={adapter_only!r}: expected 1 (accept an adapter-only resume) or "
            "nothing; compose passes RESUME_ADAPTER_ONLY"
        )
    root = None if Path(run).is_dir() else load_run_config(ns.config, overrides_of(ns)).launcher.output_root
    print(f"{RESUME_ENV}={run}: resuming that run instead of starting a new one", flush=True)
    return resume_run(run_dir_for(run, root), adapter_only=adapter_only == "1", foreground=True)


def _args_profile(p: argparse.ArgumentParser) -> None:
    add_config_arg(p)
    p.add_argument("--steps", type=int, default=3, help="steps to profile (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and not profiled (default 2)")
    p.add_argument("--quiet", action="store_true", help="do not echo the job's output (it still goes to the log)")


def _cmd_profile(ns: argparse.Namespace) -> int:
    from launcher.run.profile import profile_run

    return profile_run(ns.config, overrides_of(ns), steps=ns.steps, warmup=ns.warmup, echo=not ns.quiet)


def _cmd_start(ns: argparse.Namespace) -> int:
    from launcher.config.run_config import load_run_config
    from launcher.run.lock import check_free

    config = load_run_config(ns.config, overrides_of(ns))  # fast host-side errors before anything is spawned
    check_free(config.launcher.output_root)  # refuse at once; the supervisor checks again under the lock
    from launcher.run.control import start_detached

    return start_detached(config)


def _args_supervise(p: argparse.ArgumentParser) -> None:
    add_config_arg(p)
    p.add_argument("--handshake-fd", type=int, required=True)
    p.add_argument("--resume", default=None, help="the resume plan as JSON")


def _cmd_supervise(ns: argparse.Namespace) -> int:
    from launcher.run.signals import StopRequested
    from launcher.run.supervisor import Handshake

    handshake = Handshake(os.fdopen(ns.handshake_fd, "w"))
    try:  # `start` waits for one line: why the run was refused, or that it exists (a second refusal is not sent)
        from launcher.config.run_config import load_run_config
        from launcher.run.resume import ResumePlan
        from launcher.run.supervisor import supervise

        config = load_run_config(ns.config, overrides_of(ns))  # changed since `start` read it: say so
        resume = ResumePlan.from_json(ns.resume) if ns.resume else None
        return supervise(config, echo=False, handshake=handshake, resume=resume)
    except LauncherError as err:
        handshake.refuse(err)
        raise
    except StopRequested as stop:  # `main` says so here and exits 128 + the signal; `start` fails with the line
        handshake.refuse(LauncherError(stop.before_the_run(), ExitCode.FAILED))
        raise


def _args_check(p: argparse.ArgumentParser) -> None:
    add_config_arg(p)
    p.add_argument(
        "--no-model",
        action="store_true",
        help="do not read the model folder (the checks this skips are listed as not made); for a "
        "config whose data and output folders are elsewhere too: --for-another-machine",
    )
    p.add_argument(
        "--for-another-machine",
        action="store_true",
        help="the config is meant for another machine (checking on a laptop for the server): a path it "
        "names that is not here (model, dataset_dir, output root) is counted as a check not made, "
        "instead of failing the check; what is here is checked as usual",
    )
    _add_device_memory(p)


def _add_device_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device-memory",
        metavar="GIB",
        default=None,
        help="the memory of one device in GiB, for the memory forecast's verdict (default: read through "
        "torch where the run's devices are visible)",
    )


def _device_memory(ns: argparse.Namespace) -> float | None:
    from launcher.checks.memory import parse_gib

    if ns.device_memory is None:
        return None
    try:
        return parse_gib(ns.device_memory)
    except ValueError as err:
        raise LauncherError(str(err), ExitCode.USAGE) from None


def _cmd_check(ns: argparse.Namespace) -> int:
    """Every problem of the config in one pass; 0 when none, 2 otherwise. The checks it could not make here
    are counted and listed, with why, after the verdict: never a bare OK."""
    from launcher.checks.config_check import SKIPPED
    from launcher.checks.config_rules import check_run_config
    from launcher.config.run_config import ConfigError, read_run_config

    elsewhere = ns.for_another_machine
    device_gib = _device_memory(ns)
    config, problems = read_run_config(ns.config, overrides_of(ns), require_model=not (ns.no_model or elsewhere))
    if config is None:
        raise ConfigError(str(ns.config), problems)
    found = check_run_config(
        config,
        problems=problems,
        model=not ns.no_model,
        devices=False,
        elsewhere=elsewhere,
        memory=True,
        device_gib=device_gib,
    )
    marks = {"error": "ERROR", "warn": "warn ", "ok": "ok   ", "skipped": "skip "}
    for finding in found.items:
        if finding.level != SKIPPED:
            print(f"{marks[finding.level]}  {finding.message}")
    for note in config.notes:
        print(f"note   {note}")
    errors, skipped = found.errors, found.skipped
    launcher = config.launcher
    if errors:
        verdict = f"{ns.config}: {len(errors)} problem(s); fix them and run `launcher check {ns.config}` again"
    else:
        verdict = (
            f"{ns.config}: OK ({launcher.backend} backend, {launcher.nproc_per_node} process(es) per node, "
            f"{launcher.distribution}{', smoke' if launcher.smoke else ''})"
        )
    if skipped:
        verdict += f"; {len(skipped)} check{'s' if len(skipped) > 1 else ''} not made here:"
    print(verdict)
    for finding in skipped:
        print(f"{marks[SKIPPED]}  {finding.message}")
    return ExitCode.USAGE if errors else ExitCode.OK


def _args_preflight(p: argparse.ArgumentParser) -> None:
    add_config_arg(p)
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")
    _add_device_memory(p)


def _cmd_preflight(ns: argparse.Namespace) -> int:
    """0 when every row passed, 1 when one failed, 2 when the config is invalid."""
    from launcher.checks.preflight import run_preflight
    from launcher.config.run_config import load_run_config
    from launcher.run.setup import prepare

    device_gib = _device_memory(ns)
    report = run_preflight(prepare(load_run_config(ns.config, overrides_of(ns))), device_gib=device_gib)
    report.render()
    if ns.json is not None:
        print(f"report: {report.write(ns.json)}", file=sys.stderr)
    return ExitCode.OK if report.ok else ExitCode.FAILED


def _args_kernel_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("cpu", "cuda", "npu"), required=True)
    p.add_argument(
        "--kernel",
        choices=("auto", "fla", "torch"),
        default="auto",
        help="launcher.patches.deltanet_routing.kernel of the config (default auto)",
    )
    p.add_argument("--no-suite", action="store_true", help="skip the quick validate-kernels suite")
    p.add_argument(
        "--glue",
        default="conv,rms_norm,gated_norm,swiglu",
        metavar="OPS",
        help="the fused glue ops the run binds (launcher.patches.fused_ops), checked in the quick suite; "
        "'none' for none",
    )
    p.add_argument(
        "--shapes",
        default=None,
        metavar="JSON",
        help="the run's DeltaNet shapes (seq_len, key_heads, value_heads, head_dim) for the kernel choice "
        "on NPU; default the 27B model's at 4,096 tokens",
    )


def _cmd_kernel_check(ns: argparse.Namespace) -> int:
    """One JSON line on stdout (preflight reads it); 0 when the kernel passed."""
    from launcher.checks.kernels.check import check

    glue = tuple(op for op in ns.glue.split(",") if op and op != "none")
    shapes = json.loads(ns.shapes) if ns.shapes else None
    result = check(ns.backend, ns.kernel, suite=not ns.no_suite, glue_ops=glue, shapes=shapes)
    print(json.dumps(result), flush=True)
    return ExitCode.OK if result["ok"] else ExitCode.FAILED


def _args_stop(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument(
        "--grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds for the save on stop, or between SIGTERM and SIGKILL (default: the run's stop_grace_s)",
    )
    p.add_argument(
        "--now", action="store_true", help="skip the save on stop: SIGTERM at once, SIGKILL after the grace period"
    )


def _cmd_stop(ns: argparse.Namespace) -> int:
    from launcher.run.control import stop_run

    return stop_run(run_dir(ns), ns.grace, now=ns.now)


def _args_resume(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="accept a checkpoint without optimizer/scheduler state (save_only_model: true)",
    )
    p.add_argument("--foreground", action="store_true", help="supervise in the foreground, like `run`")


def _cmd_resume(ns: argparse.Namespace) -> int:
    from launcher.run.control import resume_run

    return resume_run(run_dir(ns), adapter_only=ns.adapter_only, foreground=ns.foreground)


def _args_submit(p: argparse.ArgumentParser) -> None:
    add_config_arg(p)
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes (one task, one launcher each)")
    p.add_argument("--partition", default=None, metavar="P", help="Slurm partition (sbatch --partition)")
    p.add_argument(
        "--time",
        default=None,
        metavar="T",
        help="Slurm time limit (sbatch --time, e.g. 1-00:00:00); the run is stopped with a checkpoint "
        "saved stop_grace_s + 60 s before it",
    )
    p.add_argument(
        "--runtime",
        choices=("host", "apptainer", "docker"),
        default="host",
        help="what srun starts on each node: the installed launcher (host, the default: sites without a "
        "container runtime), or the project's image through apptainer or docker (--image)",
    )
    p.add_argument("--image", default=None, help="the project's image: an .sif file (apptainer) or an image name")
    p.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="one more #SBATCH line, e.g. --sbatch=--account=ml (repeatable)",
    )


def _cmd_submit(ns: argparse.Namespace) -> int:
    from launcher.config.run_config import load_run_config
    from launcher.run.placement.slurm import SlurmPlacement

    config = load_run_config(ns.config, overrides_of(ns))
    return SlurmPlacement.start(
        config,
        nodes=ns.nodes,
        partition=ns.partition,
        time_limit=ns.time,
        runtime=ns.runtime,
        image=ns.image,
        extra=tuple(ns.sbatch),
    )


def _args_slurm_node(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="the run folder `launcher submit` made")


def _cmd_slurm_node(ns: argparse.Namespace) -> int:
    from launcher.run.slurm_node import run_node

    return run_node(ns.run_dir.resolve())


VERBS: tuple[Verb, ...] = (
    Verb(
        "run",
        "train in the foreground: validate, create a run directory, supervise the job to its end",
        "launcher run configs/demo_cpu.yaml\n  launcher run configs/qwen3_5_27b_lora_soulchat.yaml\n\n"
        + EXIT_CODE_TABLE,
        _args_run,
        _cmd_run,
        supervises=True,
    ),
    Verb(
        "profile",
        "a short supervised run that profiles N steps after W warm-up steps on every rank: "
        "profile.md says where a step's time goes",
        "launcher profile configs/demo_cpu.yaml\n"
        "  launcher profile configs/qwen3_5_27b_lora_soulchat.yaml --steps 3 --warmup 2\n"
        "  (on the NPU server: docker compose run --rm train launcher profile configs/CONFIG.yaml)",
        _args_profile,
        _cmd_profile,
        supervises=True,
    ),
    Verb(
        "start",
        "start a run in the background (survives the SSH session) and return at once",
        "launcher start configs/qwen3_5_27b_lora_soulchat.yaml",
        add_config_arg,
        _cmd_start,
    ),
    Verb(
        "submit",
        "submit a run to Slurm: an sbatch script in a new run folder, one launcher per node by srun",
        "launcher submit configs/demo_cpu.yaml --nodes 2\n"
        "  launcher submit configs/qwen3_5_27b_lora_soulchat.yaml --nodes 2 --partition npu --time 1-00:00:00\n"
        "  launcher submit CONFIG --nodes 2 --runtime apptainer --image deltanet-npu.sif\n"
        "  launcher status RUN_DIR   (the run state and the Slurm job's state)\n"
        "  launcher stop RUN_DIR     (a checkpoint on every node, then exit; scancel after the grace)",
        _args_submit,
        _cmd_submit,
    ),
    Verb(
        "stop",
        "stop a run: a checkpoint at the next step, then exit; SIGTERM and SIGKILL after the grace period",
        "launcher stop\n  launcher stop demo-cpu-20261130-101500 --grace 300\n  launcher stop --now\n"
        "  launcher stop --root outputs/runs RUN   (on the host, for a run in a container: through the Docker "
        "engine, as docker stop)",
        _args_stop,
        _cmd_stop,
    ),
    Verb(
        "resume",
        "continue a stopped or failed run from its last complete checkpoint (a new attempt)",
        "launcher resume demo-cpu-20261130-101500\n  launcher resume RUN --adapter-only\n"
        "  launcher resume --root outputs/runs RUN   (on the host, for a run in a container: in a new container "
        "made from the run's own)",
        _args_resume,
        _cmd_resume,
        supervises=True,
    ),
    Verb(
        "check",
        "validate a run config (launcher section and LLaMA-Factory's own parser) without training",
        "launcher check configs/qwen3_5_27b_lora_soulchat.yaml\n"
        "  launcher check configs/qwen3_5_27b_lora_soulchat.yaml --for-another-machine   (on a laptop: the "
        "model, data and\n    output folders named in the config are on the server; they are counted as not "
        "checked)\n"
        "  launcher check configs/qwen3_5_27b_lora_soulchat.yaml --no-model   (do not read the model folder)\n"
        "  launcher check configs/qwen3_5_27b_lora_soulchat.yaml --device-memory 64   (the memory forecast's "
        "verdict for a 64 GB 910B)",
        _args_check,
        _cmd_check,
    ),
    Verb(
        "preflight",
        "check backend, devices, driver, packages, DeltaNet kernel, model, data and output space; print a table",
        "launcher preflight configs/qwen3_5_27b_lora_soulchat.yaml\n"
        "  launcher preflight configs/demo_cpu.yaml --json preflight.json\n"
        "  launcher preflight configs/qwen3_5_27b_lora_soulchat.yaml --device-memory 64",
        _args_preflight,
        _cmd_preflight,
    ),
    Verb(
        "_supervise",
        "internal: the detached supervisor started by `launcher start`",
        "",
        _args_supervise,
        _cmd_supervise,
        hidden=True,
        supervises=True,
    ),
    Verb(
        "_slurm-node",
        "internal: one node's launcher of a submitted run, started by srun",
        "",
        _args_slurm_node,
        _cmd_slurm_node,
        hidden=True,
        supervises=True,
    ),
    Verb(
        "_kernel-check",
        "internal: preflight's DeltaNet kernel check, run in a child process",
        "",
        _args_kernel_check,
        _cmd_kernel_check,
        hidden=True,
    ),
)
