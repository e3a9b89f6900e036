"""Preflight: everything that can be checked before a long run starts, as one table.

``launcher preflight CONFIG`` prints it; the supervisor runs it once the run directory exists, records
it as ``preflight.json`` there, and refuses to start training when a row failed.

Rows (status ``ok``, ``warn``, ``fail`` or ``skip``; only ``fail`` stops a run):

- ``backend``: the resolved backend and its visible devices against ``launcher.nproc_per_node``
- ``shm``: /dev/shm large enough for the collectives (npu, cuda)
- ``cann``: the CANN environment is in effect in this process (npu)
- ``driver``: the host driver version (mounted read-only) against the HDK lines the image's CANN supports
- ``packages``: installed versions against the lock file the image was built from
- ``triton``: community triton absent next to triton-ascend (npu); a Triton FLA accepts on Hopper (cuda)
- ``kernel``: the Gated DeltaNet kernel runs on the device, forward and backward (``launcher.checks.kernels.check``);
  on NPU with ``kernel: auto`` the chunk kernel, the convolution and the gated norm are chosen there by validation
  at the run's shapes (``launcher.checks.kernels.choice``; the record is ``preflight.json``'s ``kernel_choice``), and
  a torch fallback fails the row unless ``launcher.patches.deltanet_routing.allow_torch_fallback: true``
- ``model.*``: model type, layer pattern, weights, tokenizer, checksum manifest (``launcher.checks.model``)
- ``memory``: the forecast peak per device, term by term, against the device's memory (``launcher.checks.memory``);
  it decides ``checkpoint_all_layers.offload_inputs: auto`` (the record is ``preflight.json``'s ``offload_inputs``,
  which the ranks read) and fails when offloaded inputs need more pinned memory than the host has available
- ``dataset``: datasets registered in ``dataset_info.json``, files present and readable (``launcher.checks.data_check``)
- ``output``: the output root is writable and has enough free space (``launcher.checks.data_check``)

``LAUNCHER_PREFLIGHT_SKIP=kernel,model.checksums`` skips rows by name (recorded as ``skip``); tests and
quick demos use it, a formal run should not.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.version import InvalidVersion, Version

from launcher.checks import model as modelcheck
from launcher.checks import packages
from launcher.checks.data_check import check_dataset, check_output
from launcher.checks.devices import check_devices
from launcher.checks.memory import check_memory
from launcher.config import backend as backends
from launcher.config.run_config import cutoff_len
from launcher.files import write_json_atomic
from launcher.state.record import now_iso
from launcher.state.runs import PREFLIGHT_FILE

if TYPE_CHECKING:
    from launcher.config.run_config import Prepared

SKIP_ENV = "LAUNCHER_PREFLIGHT_SKIP"
# Ascend HDK (driver) lines each CANN release supports; source: CANN 8.5.0 release notes, "CANN
# version mapping" (Ascend HDK 25.5.X, 25.3.X, 25.2.X, 25.0.X).
CANN_DRIVER_SUPPORT = {"8.5.0": ("25.0", "25.2", "25.3", "25.5")}
DEFAULT_DRIVER_DIR = Path("/usr/local/Ascend/driver")
# The packages launcher/ and patches/ were written against (pyproject's `train` extra). They must match
# the lock on every backend; the accelerator stack only has to match inside the images (npu, cuda).
TRAINING_STACK = ("llamafactory", "transformers", "peft", "accelerate", "trl", "datasets", "tokenizers")
KERNEL_TIMEOUT_S = 900
FLA_HOPPER_BAD_TRITON = (Version("3.4.0"), Version("3.7.1"))  # fla-org/flash-linear-attention#640


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != "fail"


@dataclass
class PreflightReport:
    config: str
    backend: str
    checks: list[Check] = field(default_factory=list)
    created: str = field(default_factory=now_iso)
    data_stats: dict[str, Any] | None = None  # the short token statistics, written as data_stats.json
    kernel_choice: dict[str, Any] | None = None  # on NPU: each DeltaNet component's kernel, what was refused
    offload_inputs: dict[str, Any] | None = None  # the memory row's checkpoint_all_layers.offload_inputs decision

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("data_stats")  # its own file
        return {"ok": self.ok, "failed": self.failed, **data}

    def write(self, path: Path) -> Path:
        """Write the report as JSON to ``path`` (a run directory gets ``preflight.json``)."""
        if path.is_dir():
            path = path / PREFLIGHT_FILE
        write_json_atomic(path, self.to_dict())
        return path

    def render(self, file=None) -> None:
        """Print the table (to stderr by default, so stdout stays free for the job's output)."""
        from rich.console import Console
        from rich.table import Table

        style = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
        table = Table(title=f"preflight: {self.config} (backend {self.backend})", title_justify="left")
        for column in ("check", "status", "detail"):
            table.add_column(column, overflow="fold")
        for c in self.checks:
            table.add_row(c.name, f"[{style[c.status]}]{c.status.upper()}[/]", c.detail)
        console = Console(file=file or sys.stderr, width=max(100, shutil.get_terminal_size((140, 20)).columns))
        console.print(table)
        verdict = "[green]passed[/]" if self.ok else f"[bold red]failed[/]: {', '.join(self.failed)}"
        console.print(f"preflight {verdict}")


Row = tuple[str, str, str]  # name, status, detail


def run_preflight(
    prepared: Prepared,
    skip: set[str] | None = None,
    driver_dir: Path = DEFAULT_DRIVER_DIR,
    device_gib: float | None = None,
) -> PreflightReport:
    """Run every preflight check for a validated config.

    Args:
        prepared: what ``launcher.run.setup.prepare`` returned (config and resolved backend).
        skip: row names to skip; defaults to ``$LAUNCHER_PREFLIGHT_SKIP``.
        driver_dir: the (mounted) Ascend driver folder.
        device_gib: the device memory the ``memory`` row forecasts against (``--device-memory``); default: read
            through torch.

    Returns:
        The report; ``report.ok`` is False when any row failed. Checks never raise: an unexpected error
        becomes a failed row naming it.
    """
    if skip is None:
        skip = {s.strip() for s in os.environ.get(SKIP_ENV, "").split(",") if s.strip()}
    config, backend = prepared.config, prepared.backend.name
    lf = config.llamafactory
    model_dir = Path(str(lf.get("model_name_or_path", "")))
    steps: list[tuple[str, Callable[[], list[Row]]]] = [
        ("backend", lambda: [check_backend(prepared)]),
        ("shm", lambda: [check_shm(config.launcher.nproc_per_node)] if backend != "cpu" else []),
        ("cann", lambda: [check_cann_env()] if backend == "npu" else []),
        ("driver", lambda: [check_driver(driver_dir)] if backend == "npu" else []),
        ("packages", lambda: [check_packages(backend)]),
        ("triton", lambda: [check_triton(backend)] if backend != "cpu" else []),
        (
            "kernel",
            lambda: [
                check_kernel(
                    backend,
                    _routing_kernel(prepared),
                    glue=_glue_ops(prepared),
                    shapes=_run_shapes(prepared, model_dir),
                    allow=_allow_torch(prepared),
                    out=found,
                )
            ],
        ),
        ("model", lambda: check_model(model_dir, skip)),
        ("devices", lambda: [_devices_row(prepared, stats)]),
        (
            "memory",
            lambda: [("memory", *check_memory(config, lf, backend, device_gib, stats.get("free_gib"), out=found))],
        ),
        ("dataset", lambda: [check_dataset(lf)]),
        ("output", lambda: [check_output(Path(config.launcher.output_root), config.launcher.smoke)]),
        ("data_stats", lambda: [check_data_stats(config, stats)]),
    ]
    stats: dict[str, Any] = {}
    found: dict[str, Any] = {}
    report = PreflightReport(str(config.source), backend)
    for name, step in steps:
        if name in skip:
            report.checks.append(Check(name, "skip", f"skipped ({SKIP_ENV})"))
            continue
        started = time.monotonic()
        try:
            rows = step()
        except Exception as err:  # a check that crashes is a failed check, not a crashed launcher
            rows = [(name, "fail", f"check crashed: {type(err).__name__}: {err}")]
        elapsed = round(time.monotonic() - started, 2)
        report.checks.extend(Check(n, s, d, elapsed) for n, s, d in rows)
    report.data_stats = stats.get("result")
    report.kernel_choice = found.get("kernel_choice")
    report.offload_inputs = found.get("offload_inputs")
    return report


def _devices_row(prepared: Prepared, out: dict[str, Any]) -> Row:
    """The ``devices`` row (checks/devices.py), reading the devices as the job will see them; the least free
    memory among them goes into ``out["free_gib"]`` for the memory row."""
    status, detail, out["free_gib"] = check_devices(
        prepared.backend.name, prepared.config.launcher, backends.child_env(prepared.backend)
    )
    return "devices", status, detail


def check_data_stats(config, out: dict[str, Any], sample: int = 500) -> Row:
    """Token statistics of a sample per split after the chat template (``launcher data stats``, short form).

    Fails a formal run (warns for a smoke run) on ``data.stats.problems_for``: samples left with no
    supervised token, more than ``launcher.truncation_warn_share`` of the supervised tokens cut, a
    validation split too small to select a checkpoint by. Warns when that share of samples is truncated,
    and when the run would write fewer than ``MIN_LOG_LINES`` trainer-log lines. Conversation text is
    never shown.
    """
    from launcher.data.stats import StatsError, short_stats, short_stats_line

    try:
        result = short_stats(config, sample=sample, warn_share=config.launcher.truncation_warn_share)
    except StatsError as err:
        return ("data_stats", "warn", f"token statistics not measured: {err}")
    out["result"] = result
    problems = result.get("problems") or []
    warnings = (result.get("warnings") or []) + logging_warnings(config.llamafactory, result, config.launcher)
    result["warnings"] = warnings
    detail = short_stats_line(result) + "".join(f"; PROBLEM: {p}" for p in problems)
    detail += "".join(f"; WARNING: {w}" for w in warnings)
    if problems:
        return ("data_stats", "warn" if config.launcher.smoke else "fail", detail)
    return ("data_stats", "warn" if warnings else "ok", detail)


MIN_LOG_LINES = 50  # a day-long run watched through status, ETA and curves needs this many log lines


def planned_steps(lf: dict[str, Any], train_samples: int, world_size: int) -> int | None:
    """Optimizer steps of the run as the HF Trainer plans them (``max_steps``, else epochs over the data)."""
    if int(lf.get("max_steps") or -1) > 0:
        return int(lf["max_steps"])
    batch = int(lf.get("per_device_train_batch_size") or 8) * int(lf.get("gradient_accumulation_steps") or 1)
    per_epoch = math.ceil(train_samples / max(1, batch * world_size))
    return math.ceil(per_epoch * float(lf.get("num_train_epochs") or 3.0)) if train_samples else None


def logging_warnings(lf: dict[str, Any], result: dict[str, Any], launcher: Any) -> list[str]:
    train = (result.get("splits") or {}).get("train") or {}
    steps = planned_steps(lf, int(train.get("records_total") or 0), launcher.nproc_per_node * launcher.nnodes)
    every = int(lf.get("logging_steps") or 500)  # the HF TrainingArguments default
    if steps is None or steps // every >= MIN_LOG_LINES or steps < MIN_LOG_LINES:
        return []
    wanted = max(1, steps // MIN_LOG_LINES)
    return [
        f"logging_steps {every}: the trainer log (status, ETA, loss curves) gets only {steps // every} line(s) "
        f"over the {steps} planned steps; set logging_steps: {wanted} or less"
    ]


def check_backend(prepared: Prepared) -> Row:
    launcher, backend = prepared.config.launcher, prepared.backend
    wanted = launcher.nproc_per_node
    picked = f"{backend.name}" + (" (auto)" if launcher.backend == "auto" else "")
    if backend.name == "cpu":
        cores = os.cpu_count() or 1
        status = "warn" if wanted > cores else "ok"
        return "backend", status, f"{picked}: {wanted} process(es) over {cores} core(s), {backend.collective}"
    found = backends.device_count(backend.name)
    visible = os.environ.get(backend.visible_devices_env or "", "")
    selector = f"{backend.visible_devices_env}={visible or 'unset'}"
    detail = f"{picked}: {found} device(s) visible ({selector}), config wants {wanted}"
    if found < wanted:
        return "backend", "fail", detail + "; lower launcher.nproc_per_node or expose more devices"
    return "backend", "ok", detail + f", {backend.collective}"


def check_shm(nproc: int, path: str = "/dev/shm") -> Row:
    try:
        st = os.statvfs(path)
    except OSError as err:
        return "shm", "warn", f"cannot read {path}: {err}"
    size = st.f_blocks * st.f_frsize
    gib = size / 2**30
    if nproc > 1 and size < 256 << 20:
        return "shm", "fail", f"{path} is {gib:.2f} GiB (Docker's default 64 MB); set shm_size in compose.yaml"
    if size < 4 << 30:
        return "shm", "warn", f"{path} is {gib:.1f} GiB; dataloaders and collectives may need more (shm_size)"
    return "shm", "ok", f"{path} is {gib:.0f} GiB"


def cann_version() -> str | None:
    """The CANN release the image carries (the Dockerfile bakes it in as LAUNCHER_CANN_VERSION)."""
    return os.environ.get("LAUNCHER_CANN_VERSION") or None


def check_cann_env() -> Row:
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    if not home or not Path(home).is_dir():
        return (
            "cann",
            "fail",
            (
                "the CANN environment is not in effect (ASCEND_HOME_PATH unset or missing); run inside the "
                "image, whose entrypoint sources CANN's set_env.sh, or source it yourself"
            ),
        )
    detail = f"CANN {cann_version() or 'version unknown'} at {home}"
    if shutil.which("bishengir-compile") is None:
        return "cann", "warn", detail + "; bishengir-compile not on PATH (triton-ascend needs it)"
    return "cann", "ok", detail


def read_driver_version(driver_dir: Path) -> str | None:
    """``Version=`` from the driver's version.info (e.g. 25.2.0 or 24.1.rc3); None if absent."""
    try:
        text = (driver_dir / "version.info").read_text()
    except OSError:
        return None
    match = re.search(r"^\s*(?:package_)?version\s*=\s*(\S+)", text, re.IGNORECASE | re.MULTILINE)
    return match.group(1) if match else None


def check_driver(driver_dir: Path) -> Row:
    cann = cann_version()
    version = read_driver_version(driver_dir)
    if version is None:
        return (
            "driver",
            "fail",
            (
                f"no driver version in {driver_dir}/version.info; mount the host driver read-only "
                "(compose.yaml: /usr/local/Ascend/driver)"
            ),
        )
    line = ".".join(version.split(".")[:2])
    supported = CANN_DRIVER_SUPPORT.get(cann or "")
    if supported is None:
        return "driver", "warn", f"driver {version}; image CANN {cann or 'unknown'} has no known driver table"
    try:
        newest, oldest, have = Version(supported[-1]), Version(supported[0]), Version(line)
    except InvalidVersion:
        return (
            "driver",
            "warn",
            f"driver {version}: version not understood; CANN {cann} needs HDK {', '.join(supported)}",
        )
    if line in supported:
        return "driver", "ok", f"driver {version}; CANN {cann} supports HDK {', '.join(supported)}"
    if have < oldest:
        return (
            "driver",
            "fail",
            (
                f"driver {version} is older than CANN {cann} supports (HDK {', '.join(supported)}); the host "
                "driver is not upgraded from here: use an image with an older CANN"
            ),
        )
    state = "newer than" if have > newest else "not in"
    return "driver", "warn", f"driver {version} is {state} CANN {cann}'s list (HDK {', '.join(supported)})"


def check_packages(backend: str) -> Row:
    lock = packages.lock_path(backend)
    if not lock.is_file():
        return "packages", "warn", f"{lock.name} not found next to the launcher; versions not compared"
    cmp = packages.compare_installed(packages.parse_lock(lock), lock)
    in_image = backend in ("npu", "cuda")
    hard, soft = [], []
    for text in cmp.direct_mismatch + [f"{n} missing" for n in cmp.direct_missing]:
        name = text.split()[0]
        (hard if in_image or name in TRAINING_STACK else soft).append(text)
    soft += cmp.other_mismatch + [f"{n} missing" for n in cmp.other_missing]
    head = f"{cmp.checked} locked packages vs {lock.name}"
    if hard:
        return "packages", "fail", f"{head}: {'; '.join(hard[:6])}" + (f" (+{len(hard) - 6})" if len(hard) > 6 else "")
    if soft:
        where = "" if in_image else " (not the image; only the training stack must match here)"
        return "packages", "warn", f"{head}: {len(soft)} differ{where}, e.g. {'; '.join(soft[:3])}"
    return "packages", "ok", f"{head}: all match"


def check_triton(backend: str) -> Row:
    community = packages.installed_version("triton")
    if backend == "npu":
        ascend = packages.installed_version("triton-ascend")
        if community is not None:
            return (
                "triton",
                "fail",
                (
                    f"community triton {community} is installed next to triton-ascend {ascend}; both provide "
                    "the module `triton` and break each other (pip uninstall -y triton, then reinstall triton-ascend)"
                ),
            )
        if ascend is None:
            return "triton", "fail", "triton-ascend is not installed; FLA's NPU kernels need it"
        return "triton", "ok", f"triton-ascend {ascend}, no community triton"
    if community is None:
        return "triton", "fail", "triton is not installed; FLA's CUDA kernels need it"
    low, high = FLA_HOPPER_BAD_TRITON
    if low <= Version(community) < high:
        return (
            "triton",
            "warn",
            (
                f"triton {community}: FLA refuses Hopper GPUs (H100/H200) for {low} <= triton < {high} "
                "(wrong gated DeltaNet gradients, fla-org/flash-linear-attention#640)"
            ),
        )
    return "triton", "ok", f"triton {community} (FLA accepts it on Hopper)"


def _routing_kernel(prepared: Prepared) -> str:
    settings = prepared.config.patches.get("deltanet_routing") or {}
    return str(settings.get("kernel", "auto"))


def _glue_ops(prepared: Prepared) -> str:
    """The fused glue ops the run binds (``launcher.patches.fused_ops``), for the kernel check's glue cases."""
    settings = prepared.config.patches.get("fused_ops") or {}
    if not settings.get("enabled", True):
        return "none"
    return ",".join(op for op in ("conv", "rms_norm", "gated_norm", "swiglu") if settings.get(op, True)) or "none"


def _allow_torch(prepared: Prepared) -> bool:
    settings = prepared.config.patches.get("deltanet_routing") or {}
    return bool(settings.get("allow_torch_fallback", False))


def _run_shapes(prepared: Prepared, model_dir: Path) -> dict[str, int]:
    """The run's DeltaNet shapes for the kernel choice: the model's config (the 27B model's if unreadable) and the
    run's ``cutoff_len``."""
    from launcher.checks.kernels.choice import run_shapes

    seq_len = cutoff_len(prepared.config.llamafactory)
    try:
        return run_shapes(modelcheck.read_config(model_dir), seq_len)
    except (ValueError, TypeError, OSError):  # the model rows say what is wrong with the config
        return run_shapes(None, seq_len)


def check_kernel(
    backend: str,
    kernel: str = "auto",
    timeout_s: float = KERNEL_TIMEOUT_S,
    glue: str = "conv,rms_norm,gated_norm,swiglu",
    shapes: dict[str, int] | None = None,
    allow: bool = False,
    out: dict[str, Any] | None = None,
) -> Row:
    """Run ``launcher.checks.kernels.check`` in a child process (see its docstring for why); ``out`` gets the kernel
    choice record when the child made one."""
    env = backends.child_env(backends.BACKENDS[backend])
    cmd = [sys.executable, "-m", "launcher", "_kernel-check", "--backend", backend, "--kernel", kernel, "--glue", glue]
    if shapes is not None:
        cmd += ["--shapes", json.dumps(shapes)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "kernel", "fail", f"kernel check did not finish in {timeout_s:.0f} s ({' '.join(cmd[1:])})"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return "kernel", "fail", f"kernel check exited {proc.returncode} without a result: {tail}"
    result = json.loads(lines[-1])
    if out is not None and result.get("kernel_choice") is not None:
        out["kernel_choice"] = result["kernel_choice"]
    return kernel_row(backend, result, allow)


def kernel_row(backend: str, result: dict[str, Any], allow: bool = False) -> Row:
    """The ``kernel`` row of a kernel check's result: its errors, the kernel choice, and the torch-fallback rule
    (on NPU a component that fell to torch fails the row unless the config allows it; then it warns)."""
    shape = "x".join(map(str, result.get("shape", [])))
    where = f"{result.get('kernel', '?')} on {result.get('device', '?')} [B,T,H,D]={shape} {result.get('dtype', '')}"
    record = result.get("kernel_choice")
    chosen = ""
    if record is not None:
        from launcher.checks.kernels.choice import ALLOW_KEY, summary

        chosen = f"kernel choice: {summary(record)}; "
        fallbacks = [name for name, c in record["components"].items() if c.get("chosen") == "torch"]
        if fallbacks and result.get("ok") and backend == "npu":
            text = (
                f"{chosen}{', '.join(fallbacks)} fell back to torch, every step slower as noted; "
                "launcher validate-kernels --device npu shows each failing case"
            )
            if allow:
                return "kernel", "warn", f"{text} (allowed by {ALLOW_KEY}: true)"
            return "kernel", "fail", f"{text}; fix the kernels, or accept the slowdown with {ALLOW_KEY}: true"
    if not result.get("ok"):
        where = f"on {result.get('device', '?')}" if record is not None else where
        return "kernel", "fail", f"{chosen}{where}: {result.get('error', 'failed')}"
    if "fwd_rel_err" not in result:  # the choice's cases, at the run's shapes, replaced the fixed-shape check
        suite = _suite_summary(result.get("validate_kernels"))
        return "kernel", "ok", f"{chosen}on {result.get('device', '?')} ({result.get('seconds', 0):.0f} s){suite}"
    return (
        "kernel",
        "ok",
        (
            f"{chosen}{where}: fwd+bwd rel. error {result['fwd_rel_err']:.1e}/{result['grad_rel_err']:.1e} "
            f"vs torch reference ({result.get('seconds', 0):.0f} s){_suite_summary(result.get('validate_kernels'))}"
        ),
    )


def _suite_summary(suite: dict[str, Any] | None) -> str:
    """The quick ``launcher validate-kernels`` suite that ``kernels.check`` runs after its own check."""
    if not suite:
        return ""
    return "; validate-kernels quick: " + ", ".join(f"{name} {state}" for name, state in suite["cases"].items())


def check_model(model_dir: Path, skip: set[str]) -> list[Row]:
    try:
        config = modelcheck.read_config(model_dir)
    except ValueError as err:
        return [("model.config", "fail", str(err))]
    rows: list[Row] = [("model.config", *modelcheck.check_model_type(config))]
    rows.append(("model.layers", *modelcheck.check_layer_pattern(config)))
    rows.append(("model.weights", *modelcheck.check_weights(model_dir)))
    rows.append(("model.tokenizer", *modelcheck.check_tokenizer(model_dir)))
    if "model.checksums" in skip:
        rows.append(("model.checksums", "skip", f"skipped ({SKIP_ENV})"))
    else:
        rows.append(("model.checksums", *modelcheck.check_checksums(model_dir)))
    return rows
