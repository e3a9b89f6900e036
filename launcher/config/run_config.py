"""Run configs: a LLaMA-Factory training YAML plus a ``launcher:`` section.

The file a user writes is the LLaMA-Factory YAML they already know, with one extra top-level key::

    launcher:
      backend: auto          # auto | npu | cuda | cpu
      nproc_per_node: 8      # processes (devices) per node
      distribution: fsdp2    # ddp (torchrun) | fsdp2 (accelerate launch, FSDP2)
      run_name: qwen35-27b-soulchat
      output_root: outputs/runs
      smoke: false           # true allows short runs (cutoff_len < 4096) and is recorded
      patches:
        deltanet_routing: {kernel: auto}
        checkpoint_all_layers: true

Here: the schema and the loading. The ``launcher`` part is validated with pydantic (host side, no torch);
``read_run_config`` also applies the rules a config must pass to load (``launcher.checks.config_rules``) and
collects every problem, so a user fixes them in one pass. Every other rule about a config, the LLaMA-Factory
part against its own argument dataclasses and registries among them, is asked through
``launcher.checks.config_rules.check_run_config``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

import patches
from launcher.config.backend import Backend
from launcher.config.tuning import Tuning
from launcher.errors import ExitCode, LauncherError, did_you_mean
from launcher.files import MAX_YAML_BYTES, Unreadable, load_yaml, read_regular, shown
from launcher.state.stop import DEFAULT_STOP_GRACE_S

# Keys the launcher owns in the LLaMA-Factory part: it decides where a run writes.
LAUNCHER_OWNED_KEYS = ("output_dir",)
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ConfigError(LauncherError):
    """A run config is unusable. ``problems`` holds one line per problem, each naming its key."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}", ExitCode.USAGE)

    def naming(self, keys: list[str], where: str) -> ConfigError:
        """The same problems, each about one of ``keys`` saying it was set ``where`` (not in the file)."""
        return ConfigError(
            self.source, [p + (f" (set {where})" if p.split(":", 1)[0].strip() in keys else "") for p in self.problems]
        )


class FsdpSettings(BaseModel):
    """FSDP2 settings for ``distribution: fsdp2`` (written into the run's accelerate config)."""

    model_config = ConfigDict(extra="forbid")

    wrap_classes: list[str] = Field(default_factory=lambda: ["Qwen3_5DecoderLayer", "Qwen3_5VisionBlock"])
    reshard_after_forward: bool = True
    offload_params: bool = False


class EarlyStopping(BaseModel):
    """``launcher.early_stopping``: stop once ``metric`` has not improved for ``patience`` evaluations.

    Mapped onto LLaMA-Factory's ``early_stopping_steps`` (HF's ``EarlyStoppingCallback``; it counts
    evaluations, not steps) in ``llamafactory_args``, which also keeps the best adapter.
    """

    model_config = ConfigDict(extra="forbid")

    patience: int = Field(ge=1)
    metric: str = "eval_loss"

    @field_validator("metric")
    @classmethod
    def _check_metric(cls, value: str) -> str:
        # greater_is_better is set to false, so only a loss (lower is better) can be the metric
        if not re.fullmatch(r"(eval_)?([A-Za-z0-9][A-Za-z0-9_.-]*_)?loss", value):
            raise ValueError("use an eval loss: eval_loss, or eval_<dataset>_loss with eval_on_each_dataset")
        return value


class RestartPolicy(BaseModel):
    """``launcher.restart``: resume a FAILED attempt with a retryable cause, at most ``max_restarts`` times,
    ``backoff_s`` after the failure (run/restart.py says which causes are retried)."""

    model_config = ConfigDict(extra="forbid")

    max_restarts: int = Field(default=3, ge=0, le=100)
    backoff_s: float = Field(default=60.0, ge=0)


class ProfileSettings(BaseModel):
    """``launcher.profile`` (set by ``launcher profile``): profile ``steps`` steps after ``warmup`` steps."""

    model_config = ConfigDict(extra="forbid")

    warmup: int = Field(default=2, ge=0, le=1000)
    steps: int = Field(default=3, ge=1, le=100)


class LauncherSection(BaseModel):
    """The ``launcher:`` section of a run config."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["auto", "npu", "cuda", "cpu"] = "auto"
    nproc_per_node: int = Field(default=1, ge=1, le=64)
    distribution: Literal["ddp", "fsdp2"] = "ddp"
    fsdp: FsdpSettings = Field(default_factory=FsdpSettings)
    run_name: str | None = None
    output_root: Path = Path("outputs/runs")
    smoke: bool = False
    patches: dict[str, Any] = Field(default_factory=dict)
    early_stopping: EarlyStopping | None = None
    # several nodes: one launcher per node; NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT override these
    nnodes: int = Field(default=1, ge=1)
    node_rank: int = Field(default=0, ge=0)
    master_addr: str | None = None
    master_port: int | None = Field(default=None, ge=1, le=65535)
    # supervision
    stall_minutes: float = Field(default=30.0, gt=0)  # no trainer-log progress this long -> STALLED
    stop_grace_s: float = Field(
        default=DEFAULT_STOP_GRACE_S, ge=0
    )  # save on stop (or SIGTERM), then SIGKILL after this
    stall_action: Literal["warn", "stop", "restart"] = "warn"  # after stall_minutes: restart needs `restart`
    restart: RestartPolicy | None = None  # automatic recovery of a retryable failure; off by default
    record_write_stop_s: float = Field(default=600.0, gt=0)  # record writes failing this long: stop the job
    entry: str = "launcher.entry"  # module each rank runs; replace only to wrap our entry
    # data: preflight warns when more than this share of samples is truncated at cutoff_len
    truncation_warn_share: float = Field(default=0.05, ge=0, le=1)
    # privacy: LLaMA-Factory's decoded training-example dump reaches the log only when true
    log_examples: bool = False
    # the job's environment levers: NPU dispatch and allocator, a persistent Triton cache (config/tuning.py)
    tuning: Tuning = Field(default_factory=Tuning)
    # `launcher profile`: the torch (or torch_npu) profiler over these steps of every rank (launcher/rank/profiling.py)
    profile: ProfileSettings | None = None
    # CUDA (NPU where torch_npu has it): record the allocator's history for the first N optimizer steps; a rank
    # that runs out of memory writes a snapshot to the run directory (launcher/rank/oomtrack.py); 0: off
    memory_history_steps: int = Field(default=0, ge=0, le=100000)
    # a shared server (docs/devices.md): preflight's devices row fails when another process holds more than this
    # many GiB on one of the run's devices, unless allow_busy_devices
    busy_device_gib: float = Field(default=2.0, ge=0)
    allow_busy_devices: bool = False

    @field_validator("run_name")
    @classmethod
    def _check_run_name(cls, value: str | None) -> str | None:
        if value is not None and not _RUN_NAME.match(value):
            raise ValueError("use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value


@dataclass
class Prepared:
    """A validated config and the backend it resolved to (``launcher.run.setup.prepare``)."""

    config: RunConfig
    backend: Backend


class RunConfig(BaseModel):
    """A loaded run config: the launcher section, the LLaMA-Factory arguments, and where it came from."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    source: Path
    launcher: LauncherSection
    patches: dict[str, dict[str, Any]]
    llamafactory: dict[str, Any]
    notes: list[str] = Field(default_factory=list)
    overrides: dict[str, Any] = Field(default_factory=dict)  # key=value from the command line, applied

    @property
    def run_name(self) -> str:
        return self.launcher.run_name or _RUN_NAME_FALLBACK.sub("-", self.source.stem)[:64]

    def llamafactory_args(self, backend: str, output_dir: Path) -> dict[str, Any]:
        """The LLaMA-Factory arguments the job will use: the user's, plus what the launcher decides."""
        args = dict(self.llamafactory)
        args["output_dir"] = str(output_dir)
        # LLaMA-Factory deletes trainer_log.jsonl under overwrite_output_dir; a run folder is always new.
        args.pop("overwrite_output_dir", None)
        if backend == "cpu":
            args["use_cpu"] = True  # also keeps a CPU run off any GPU the host may have
        if args.get("packing") and args.get("stage", "sft") == "sft":
            # LLaMA-Factory's plain packing lets the samples of a row attend to each other; neat packing keeps
            # them apart (block-diagonal mask, position ids per sample), which the packed_rows patch extends to
            # the DeltaNet layers. A packed sample never sees another one here (docs/data.md, "Packing").
            args["neat_packing"] = True
        early = self.launcher.early_stopping
        if early is not None:
            # LLaMA-Factory adds HF's EarlyStoppingCallback(early_stopping_patience=early_stopping_steps)
            # (llamafactory/train/tuner.py). HF tracks the best checkpoint by metric_for_best_model and never
            # rotates it away; load_best_model_at_end then puts the best adapter at the top of output/ (HF checks
            # that save and eval strategies match and save_steps is a multiple of eval_steps). Under FSDP the
            # Trainer refuses load_best_model_at_end with save_only_model, and loading would need full-model
            # checkpoints, so there world rank 0 copies the best checkpoint's adapter over the final one after
            # training (launcher/results/best_adapter.py, called by launcher/rank/entry.py) and names it in
            # best_adapter.json.
            args["early_stopping_steps"] = early.patience
            args["metric_for_best_model"] = early.metric
            args["greater_is_better"] = False
            args["load_best_model_at_end"] = self.launcher.distribution != "fsdp2"
        # ddp_backend is left to accelerate, which picks gloo/nccl/hccl from the device; setting it here
        # would make TrainingArguments initialise a process group while the launcher validates.
        return args


_RUN_NAME_FALLBACK = re.compile(r"[^A-Za-z0-9._-]")


def _pydantic_problems(err: ValidationError, prefix: str) -> list[str]:
    problems = []
    for e in err.errors():
        key = ".".join(str(p) for p in (prefix, *e["loc"]))
        if e["type"] == "extra_forbidden":
            model = _SECTION_MODELS.get(str(e["loc"][0]), LauncherSection) if len(e["loc"]) > 1 else LauncherSection
            hint = did_you_mean(str(e["loc"][-1]), model.model_fields, prefix=key.rpartition(".")[0] + ".")
            allowed = f"allowed keys: {', '.join(model.model_fields)}"
            problems.append(f"{key}: unknown key; " + (f"{hint} ({allowed})" if hint else allowed))
        else:
            problems.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return problems


_SECTION_MODELS: dict[str, type[BaseModel]] = {
    "fsdp": FsdpSettings,
    "early_stopping": EarlyStopping,
    "restart": RestartPolicy,
}


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_overrides(items: list[str], source: str = "command line") -> dict[str, Any]:
    """``key=value`` arguments after the config, as LLaMA-Factory's CLI takes them (``learning_rate=1e-4``,
    ``launcher.nproc_per_node=2``). Values are read as YAML, and numbers in e notation as numbers (YAML 1.1
    would read ``1e-4`` as text). ``source``: where the items come from, for the message.

    Raises:
        ConfigError: an item is not ``key=value``.
    """
    values: dict[str, Any] = {}
    bad = [item for item in items if "=" not in item or not item.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError(source, [f"{item!r}: an override is KEY=VALUE (e.g. learning_rate=1.0e-4)" for item in bad])
    for item in items:
        key, text = (part.strip() for part in item.split("=", 1))
        try:
            value = load_yaml(text, f"the override {key}") if text else None
        except Unreadable as err:
            raise ConfigError(source, [str(err)]) from None
        if isinstance(value, str) and _NUMBER.match(value):
            value = float(value) if any(c in value for c in ".eE") else int(value)
        values[key] = value
    return values


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:  # launcher.nproc_per_node=2 goes into the launcher section
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value


def read_run_config(
    path: Path, overrides: dict[str, Any] | None = None, require_model: bool = True
) -> tuple[RunConfig | None, list[str]]:
    """Read a run config and collect every problem of its launcher section and of the rules a config must pass
    to load (``launcher.checks.config_rules.file_problems``).

    Args:
        path: The YAML file.
        overrides: ``key=value`` overrides from the command line (``parse_overrides``), applied on top.
        require_model: Whether ``model_name_or_path`` must be a folder here (``launcher check --no-model``
            checks a config on a machine that does not hold the model).

    Returns:
        The config (None only when the file is not a YAML mapping) and the problems found, each naming
        its key. With problems the config carries defaults where its values were invalid.
    """
    if not path.is_file():
        return None, [f"config file not found: {path} (check the path; examples are in configs/)"]
    try:
        text = read_regular(path, MAX_YAML_BYTES).decode("utf-8")
    except (Unreadable, UnicodeDecodeError) as err:
        return None, [f"cannot read {shown(path)}: {shown(err)}"]
    try:
        data = load_yaml(text, shown(path))
    except Unreadable as err:
        return None, [str(err)]
    if not isinstance(data, dict):
        return None, [f"expected a mapping of LLaMA-Factory keys, got {type(data).__name__}"]
    if overrides:
        _apply_overrides(data, overrides)
    problems: list[str] = []
    notes: list[str] = []
    raw_launcher = data.pop("launcher", None) or {}
    launcher = LauncherSection()
    if not isinstance(raw_launcher, dict):
        problems.append(f"launcher: expected a mapping, got {type(raw_launcher).__name__}")
        raw_launcher = {}
    if os.environ.get("NPROC_PER_NODE"):  # honoured like NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT
        raw_launcher = {**raw_launcher, "nproc_per_node": os.environ["NPROC_PER_NODE"]}
        notes.append(f"launcher.nproc_per_node: {os.environ['NPROC_PER_NODE']} from NPROC_PER_NODE")
    try:
        launcher = LauncherSection.model_validate(raw_launcher)
    except ValidationError as err:
        problems.extend(_pydantic_problems(err, "launcher"))
        # the valid parts still count for the other rules (a smoke run is not held to the formal floor)
        launcher = LauncherSection.model_validate(_valid_part(raw_launcher, err))

    patch_settings: dict[str, dict[str, Any]] = {}
    try:
        patch_settings = patches.normalize_settings(launcher.patches)
    except ValueError as err:
        problems.append(f"launcher.patches: {err}")

    for key in LAUNCHER_OWNED_KEYS:
        if key in data:
            notes.append(
                f"{key}: {data.pop(key)!r} is ignored; the launcher writes into the run directory "
                "under launcher.output_root"
            )
    config = RunConfig(
        source=path,
        launcher=launcher,
        patches=patch_settings,
        llamafactory=data,
        notes=notes,
        overrides=overrides or {},
    )
    return config, problems + file_problems(config, require_model=require_model)


def _valid_part(raw: dict[str, Any], err: ValidationError) -> dict[str, Any]:
    bad = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
    return {k: v for k, v in raw.items() if k not in bad}


def load_run_config(path: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read and validate the host-side part of a run config (``read_run_config``, raising).

    LLaMA-Factory's own checks are a separate step (``launcher.checks.config_rules.check_run_config``) because
    they need the training stack.

    Raises:
        ConfigError: with every problem found, each naming its key.
    """
    config, problems = read_run_config(path, overrides)
    if problems or config is None:
        raise ConfigError(str(path), problems)
    return config


def dump_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


# --- the rules a config must pass to load (read_run_config applies them; checks/config_rules builds on them) ---

FORMAL_MIN_CUTOFF = 4096
# LLaMA-Factory 0.9.5's DataArguments.cutoff_len default: the one place the launcher writes it
LF_DEFAULT_CUTOFF = 2048


def cutoff_len(lf: dict[str, Any]) -> int:
    """The run's ``cutoff_len``, LLaMA-Factory's default when the config leaves it out."""
    value = lf.get("cutoff_len")
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else LF_DEFAULT_CUTOFF


def file_problems(config: RunConfig, *, require_model: bool = True) -> list[str]:
    """The rules a config must pass to load (``read_run_config`` applies them), each problem naming its key.

    Args:
        require_model: Whether ``model_name_or_path`` must be a folder here (``launcher check --no-model``
            checks a config on a machine that does not hold the model).
    """
    problems = []
    data, launcher = config.llamafactory, config.launcher
    cutoff = cutoff_len(data)  # a value that is no number is LLaMA-Factory's parser's to refuse, not this rule's
    is_number = isinstance(data.get("cutoff_len", 0), int | float) and not isinstance(data.get("cutoff_len"), bool)
    if not launcher.smoke and is_number and cutoff < FORMAL_MIN_CUTOFF:
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
