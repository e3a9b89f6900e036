"""``launcher evaluate RUN``: test loss, greedy answers and screening signals per chosen checkpoint.

Everything a user can get wrong is checked here, before any model is loaded, and answered with one message
(what, which value, the fix) and exit code 2: an unknown run, an unknown checkpoint name or step, a run whose
training data has no held-out test split (``launcher data prepare --test-size``), a test split that changed
since it was prepared or that belongs to other training data than the run's (the data was prepared again since
the run: its training file no longer has the sha256 the run's manifest recorded), a run that is still going
(its evaluation would load a second model beside the training one, on checkpoints that still change), an
unreadable ``--prompts`` file. Then one child process (``python -m launcher.rank.evaluate``, on the run's backend)
does the model work in a scratch folder inside the run directory, with the environment levers the run's job got (its
Triton cache: kernels compiled and autotuned once serve both; the caller's environment wins); only when it succeeds
are ``evaluate.json`` and ``evaluate.md`` replaced (atomically), so a failed evaluation leaves an earlier one as it
was. The scratch folder is removed either way.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from launcher.config.backend import BACKENDS, child_env
from launcher.data.demo import is_demo_model
from launcher.data.privacy import log_examples_wanted
from launcher.errors import ExitCode, LauncherError
from launcher.files import read_json_object, sha256_file, write_json_atomic, write_text_atomic
from launcher.results.curves import read_trainer_state
from launcher.results.evaluate import (
    build_document,
    load_crisis_prompts,
    read_prompts_file,
    render_markdown,
)
from launcher.results.report import build_report
from launcher.run.placement import placement_of
from launcher.run.placement.container import compose_run_command, container_mounts
from launcher.run.signals import STOP_SIGNALS, interrupt_on_signal
from launcher.state.checkpoints import scan_checkpoints
from launcher.state.procs import terminate, tree
from launcher.state.runfiles import Manifest, RunFiles, eval_dataset_names, load_run_files, read_launch
from launcher.state.runs import (
    ADAPTER_FILE,
    CHECKPOINT_FOLDER,
    EVALUATE_JSON,
    EVALUATE_LOG,
    EVALUATE_MD,
    EVALUATE_REQUEST,
    EVALUATE_RESULT,
    EVALUATE_SCRATCH,
    LAUNCH_FILE,
    OUTPUT_SUBDIR,
)

DEFAULT_CHECKPOINTS = "best,last"
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_MAX_PROMPTS = 32
# prompts per greedy batch: ``auto`` takes as many as the device's free memory holds beside the model, by the
# forecast of a row (``launcher.rank.evaluate_decode.auto_rows``; docs/evaluate.md, "Batch size")
DEFAULT_BATCH_SIZE = "auto"
LOG_TAIL = 40
CHILD_STOP_GRACE_S = 30  # an interrupted evaluation's child: SIGTERM, then SIGKILL after this
CHILD = "launcher.rank.evaluate"


def _usage(message: str) -> LauncherError:
    return LauncherError(message, ExitCode.USAGE)


def batch_size_setting(text: str) -> int | str:
    """``--batch-size``: ``auto`` or a positive number of prompts; ``LauncherError`` (usage) saying how to fix it."""
    if text.strip().lower() == DEFAULT_BATCH_SIZE:
        return DEFAULT_BATCH_SIZE
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise _usage(
            f"--batch-size {text}: not a number of prompts per batch; give a positive integer, e.g. "
            f"--batch-size 16, 1 for one prompt at a time, or {DEFAULT_BATCH_SIZE} (the default: as many as "
            "the device's free memory holds)"
        )
    return value


def choose_checkpoints(run_dir: Path, spec: str) -> list[dict[str, Any]]:
    """``best,last,STEP,...`` -> the complete checkpoints they name, in order, each once.

    ``best``: the lowest validation loss (as ``launcher report`` selects); ``last``: the highest step; a number:
    ``checkpoint-STEP``; ``final``: the adapter in ``output/``.

    Raises:
        LauncherError: a name or step that names no complete checkpoint (the message lists those there are).
    """
    files = load_run_files(run_dir)
    found, _ignored = scan_checkpoints(files.output)
    by_step = {c.step: c for c in found}
    have = ", ".join(CHECKPOINT_FOLDER.format(step=s) for s in by_step) or "none"
    fix = f"complete checkpoints in {files.output}: {have}; use best, last, final or one of their steps"
    chosen: dict[str, dict[str, Any]] = {}
    for item in [s.strip() for s in spec.split(",") if s.strip()] or DEFAULT_CHECKPOINTS.split(","):
        if item == "final":
            if not (files.output / ADAPTER_FILE).is_file():
                raise _usage(f"--checkpoints final: {files.output} holds no final adapter yet; {fix}")
            chosen.setdefault(
                "final", {"name": "final", "step": _final_step(files.output, found), "path": str(files.output)}
            )
            continue
        if item in ("best", "last"):
            if not found:
                raise _usage(f"--checkpoints {item}: the run has no complete checkpoint; {fix}")
            ckpt = found[-1] if item == "last" else _best(run_dir, by_step)
            if ckpt is None:
                raise _usage(f"--checkpoints best: no saved checkpoint has a validation loss; {fix}")
        else:
            step = item.removeprefix(CHECKPOINT_FOLDER.format(step=""))
            if not step.isdigit():
                raise _usage(f"--checkpoints {item!r}: not best, last, final or a step number; {fix}")
            ckpt = by_step.get(int(step))
            if ckpt is None:
                raise _usage(f"--checkpoints {item}: there is no complete checkpoint-{int(step)}; {fix}")
        name = ckpt.path.name
        chosen.setdefault(name, {"name": name, "step": ckpt.step, "path": str(ckpt.path)})
    return list(chosen.values())


def _final_step(output: Path, found) -> int:
    """The step of the final adapter: the Trainer's last ``global_step``, else the last checkpoint's."""
    state, _ = read_trainer_state(output)
    step = (state or {}).get("global_step")
    return int(step) if isinstance(step, int) else (found[-1].step if found else 0)


def _best(run_dir: Path, by_step):
    report = build_report(run_dir, write=False, plot=False)
    name = report.recommended if report.recommended and report.recommended != OUTPUT_SUBDIR else None
    return next((c for c in by_step.values() if name and Path(name).name == c.path.name), None)


def find_test_split(lf: dict[str, Any], manifest: Manifest | None, dataset_dir: Path | None = None) -> dict[str, Any]:
    """The held-out test split of the run's training data: its ``NAME.prepare.json`` record, checked.
    ``dataset_dir``: where that data is here (``host_inputs``), else where the run recorded it.

    Raises:
        LauncherError: the training data has no test split, or the file is missing or changed since prepare.
    """
    recorded = manifest.data.get("dataset_dir") if manifest else None
    dataset_dir = dataset_dir or Path(str(recorded or lf.get("dataset_dir", "data")))
    names = [n.strip() for n in str(lf.get("dataset") or "").split(",") if n.strip()]
    info = read_json_object(dataset_dir / "dataset_info.json")
    info = info if isinstance(info, dict) else {}
    for name in names:
        record = read_json_object(dataset_dir / f"{name}.prepare.json")
        test = record.get("test") if isinstance(record, dict) else None
        if not isinstance(test, dict) or name not in info:
            continue
        path = dataset_dir / str(test.get("file"))
        if not path.is_file():
            raise _usage(
                f"the test split {path} recorded in {name}.prepare.json is missing; run `launcher data prepare` "
                "again with the same --seed and --test-size (and --force), or restore the file"
            )
        if sha256_file(path) != test.get("sha256"):
            raise _usage(
                f"the test split {path} changed since `launcher data prepare` wrote it (sha256 differs from "
                f"{name}.prepare.json); restore it or prepare the data again"
            )
        _require_trained_on(name, dataset_dir / str(info[name].get("file_name")), manifest, path)
        evals = set(eval_dataset_names(lf))
        entry = {k: v for k, v in info[name].items() if k != "file_name"}  # the test file is read as its train set
        return {
            "dataset": name,
            "path": str(path),
            "file": path.name,
            "sha256": test["sha256"],
            "samples": test.get("samples"),
            "dataset_info": entry,
            "eval_datasets": sorted(evals),
        }
    raise _usage(
        f"no held-out test split for this run: its training dataset(s) {', '.join(names) or '(none)'} in "
        f"{dataset_dir} have no test split recorded in NAME.prepare.json; prepare the data with a test split "
        "(launcher data prepare SRC --out DIR --test-size 0.05) and train on it, so the test split stays "
        "independent of training and of checkpoint selection"
    )


def _require_trained_on(name: str, train_file: Path, manifest: Manifest | None, test: Path) -> None:
    """The test split on disk was held out of the very file the run trained on: that file is unchanged since
    the run (its sha256 in the run's manifest), so the prepare that wrote both is the run's."""
    trained = manifest.data.get("files", {}).get(name, {}) if manifest else {}
    if not trained.get("sha256"):
        raise _usage(
            f"the run's manifest.json records no sha256 of its training file for {name}, so {test} "
            "cannot be shown to be held out of what it trained on; evaluate a run this launcher "
            "started"
        )
    now = sha256_file(train_file) if train_file.is_file() else None
    if now != trained["sha256"]:
        state = "is missing" if now is None else "changed since the run (the data was prepared again)"
        raise _usage(
            f"{train_file} {state}, so the test split {test} beside it is not the one held out of this "
            "run's training data and may overlap it; prepare the data again with the run's --seed and "
            "--test-size (the run's config and the prepare record name them), or evaluate a run trained "
            "on the current data"
        )


def _given_folder(option: str, path: Path, marker: str, what: str) -> Path:
    if not (path / marker).is_file():
        raise _usage(f"{option} {path}: no {marker} there; give the folder that holds {what}")
    return path.resolve()


def _through_mounts(recorded: str, mounts: list[tuple[str, str]]) -> Path | None:
    """Where a path of the container is here, through the deepest mount that holds it; None when none does or
    the host's side of it is not there."""
    holders = [(inside, here) for inside, here in mounts if recorded == inside or recorded.startswith(inside + "/")]
    if not holders:
        return None
    inside, here = max(holders, key=lambda m: len(m[0]))
    found = Path(here) / Path(recorded).relative_to(inside)
    return found if found.exists() else None


def host_inputs(
    files: RunFiles, *, model_dir: Path | None, data_dir: Path | None, options: list[str]
) -> tuple[str | None, Path | None]:
    """The base model and the data folder the evaluation reads here: ``--model`` and ``--data-dir`` when given;
    else, for a run that ran in a container, the paths it recorded there (manifest.json) mapped through the
    container's mounts, as the engine reports them (else as they are, where they exist here). ``None``: the run's
    own value (a run of this machine).

    Raises:
        LauncherError: an option names no model or data folder; or a container run's model or data is not here
            and no mount holds it (the message gives the options, and the ``docker compose run`` command that
            evaluates the run in its image with ``options``).
    """
    model = _given_folder("--model", model_dir, "config.json", "the base model") if model_dir else None
    data = _given_folder("--data-dir", data_dir, "dataset_info.json", "the run's data") if data_dir else None
    record, manifest = files.status, files.manifest
    placement = placement_of(record) if record is not None else None
    if placement is None or not placement.own_files or (model and data):
        return (str(model) if model else None), data
    wanted = {
        "model": (
            model,
            "--model",
            (manifest.model.get("path") if manifest else None) or files.lf_args.get("model_name_or_path"),
        ),
        "data": (
            data,
            "--data-dir",
            (manifest.data.get("dataset_dir") if manifest else None) or files.lf_args.get("dataset_dir"),
        ),
    }
    todo = {what: (option, str(path)) for what, (given, option, path) in wanted.items() if not given and path}
    mounts, why = container_mounts(record) if todo else ([], None)
    # the mount first: a path of the container that also exists here may be another folder
    found = {
        what: _through_mounts(path, mounts) or (Path(path) if Path(path).exists() else None)
        for what, (_option, path) in todo.items()
    }
    unmapped = {what: todo[what] for what, here in found.items() if here is None}
    if unmapped:
        paths = " and ".join(f"{what} {path}" for what, (_option, path) in unmapped.items())
        give = " ".join(f"{option} DIR" for option, _path in unmapped.values())
        raise _usage(
            f"{files.run_id} ran in {placement.where()}: "
            f"its {paths} {'is' if len(unmapped) == 1 else 'are'} not on this machine and "
            f"{why or 'no mount of the container holds ' + ('it' if len(unmapped) == 1 else 'them')}; give "
            f"the host's copy with {give}, or evaluate it in its image, from the compose folder with the "
            f"run's OUTPUTS_DIR: {compose_run_command(record, 'evaluate', *options)}"
        )
    model = model or found.get("model")
    data = data or found.get("data")
    return (str(model) if model else None), data


def require_ended(run_dir: Path) -> None:
    """Refuse a run that has not ended: a pending, running, finishing or stalled one."""
    from launcher.state.record import RecordUnreadable, read_record

    try:
        record = read_record(run_dir)
    except RecordUnreadable as exc:
        raise _usage(f"{run_dir.name}: its status cannot be read ({exc}); evaluate a run that has ended") from exc
    if not record.terminal:
        raise _usage(
            f"{run_dir.name} is {record.state.value}: evaluating it would load a second model beside the "
            "training one and read checkpoints that still change; wait until it ends (launcher status), "
            f"or stop it first (launcher stop {run_dir.name})"
        )


def run_levers(manifest: Manifest | None) -> dict[str, str]:
    """The environment levers the run's job got (``manifest.json``'s ``tuning``: the Triton cache and, on NPU,
    torch-npu's queue, affinity and allocator), for the evaluation's child."""
    levers = manifest.tuning if manifest else {}
    return {name: lever["value"] for name, lever in levers.items() if isinstance(lever.get("value"), str)}


def build_request(
    run_dir: Path,
    *,
    checkpoints: str,
    prompts_file: Path | None,
    max_new_tokens: int,
    max_prompts: int,
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    model_dir: Path | None = None,
    data_dir: Path | None = None,
    options: list[str] | None = None,
) -> dict[str, Any]:
    """Everything the child needs, checked (see the module docstring for what is refused). ``model_dir`` and
    ``data_dir``: the base model and data folders here (``host_inputs``); ``options``: the command line's own, for
    the command that evaluates a container run in its image."""
    if max_new_tokens < 1:
        raise _usage(f"--max-new-tokens {max_new_tokens}: generate at least 1 token, e.g. --max-new-tokens 128")
    if max_prompts < 0:
        raise _usage(f"--max-prompts {max_prompts}: use 0 (all test conversations) or more")
    batch_size = batch_size_setting(str(batch_size))
    files = load_run_files(run_dir)
    require_ended(run_dir)
    launch, problem = read_launch(run_dir)
    if launch is None or not files.lf_args:
        problem = problem or (f"{run_dir / LAUNCH_FILE} is missing" if launch is None else None)
        problem = problem or "; ".join(files.problems) or "no LLaMA-Factory arguments"
        raise _usage(f"{run_dir} cannot be evaluated: {problem} (evaluate a run that `launcher run` started)")
    backend = launch.backend
    if backend not in BACKENDS:
        raise _usage(f"{run_dir / LAUNCH_FILE}: backend {backend!r} is not one of {', '.join(BACKENDS)}")
    model, data = host_inputs(files, model_dir=model_dir, data_dir=data_dir, options=options or [])
    lf_args = {**files.lf_args, **({"model_name_or_path": model} if model else {})}
    extra = read_prompts_file(prompts_file) if prompts_file is not None else []
    extra += [{"id": p["id"], "kind": "crisis", "prompt": p["text"], "reference": None} for p in load_crisis_prompts()]
    return {
        "run_id": files.run_id,
        "run_dir": str(run_dir),
        "backend": backend,
        "patches": launch.patches,
        "facts": launch.facts,
        "log_examples": log_examples_wanted(run_dir),
        "lf_args": lf_args,
        "checkpoints": choose_checkpoints(run_dir, checkpoints),
        "test_split": find_test_split(lf_args, files.manifest, data),
        "extra_prompts": extra,
        "max_new_tokens": max_new_tokens,
        "max_test_prompts": max_prompts,
        "batch_size": batch_size,
        "environment": run_levers(files.manifest),
        "demo_model": is_demo_model(Path(str(lf_args.get("model_name_or_path", "")))),
    }


@contextlib.contextmanager
def _stop_signals_as(handler):
    """Ctrl-C, ``kill`` and a closed terminal (SIGINT, SIGTERM, SIGHUP) handled by ``handler`` inside the block; as
    they were outside it. Only the main thread can set handlers (and only it receives them): elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous)


def _run_child(cmd: list[str], backend, log: Path, scratch_log: Path, environment: dict[str, str] | None = None) -> int:
    """Run the child with its whole output in ``log``; only its ``evaluate:`` progress lines (counts) are
    printed, plus the log's last lines when it fails. The log replaces the previous one when the child ends.
    While the child runs, a stop signal to this process alone (Ctrl-C, ``kill``, a closed terminal) interrupts it
    as Ctrl-C does; the child is stopped (SIGTERM, SIGKILL after ``CHILD_STOP_GRACE_S``; stop signals are ignored
    meanwhile) before the interrupt goes on (``SignalInterrupt``: ``launcher`` exits 128 + the signal), and the
    previous log stays. ``environment``: variables the child gets where the caller's environment has none (the run's
    levers: the same Triton cache as its job, so kernels compiled and autotuned once serve both)."""
    tail: list[str] = []
    # the user's working folder, as for the job: relative paths in the run's YAML mean the same here
    with scratch_log.open("w", encoding="utf-8") as out:
        env = child_env(backend)
        for name, value in (environment or {}).items():
            env.setdefault(name, value)
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        assert proc.stdout is not None
        try:
            with _stop_signals_as(interrupt_on_signal):
                for line in proc.stdout:
                    out.write(line)
                    tail = [*tail[-(LOG_TAIL - 1) :], line]
                    if line.startswith("evaluate: "):
                        print(line, end="", flush=True)
                code = proc.wait()
        except BaseException:  # the child holds the device: it goes too, whatever else arrives meanwhile
            with _stop_signals_as(signal.SIG_IGN):
                terminate(tree(proc.pid), CHILD_STOP_GRACE_S)
            raise
    scratch_log.replace(log)
    if code != 0:
        print("".join(tail), end="", file=sys.stderr, flush=True)
    return code


def evaluate_run(run_dir: Path, request: dict[str, Any], *, show: bool = False, child: str = CHILD) -> dict[str, Any]:
    """Run the child on ``request`` and write evaluate.json/md; returns the document. ``child``: the module run as
    ``python -m CHILD REQUEST_JSON`` (``benchmarks.evaluate_entry`` wraps the default one for measuring).

    Raises:
        LauncherError: the child failed (exit code 1); evaluate.json and evaluate.md are left as they were.
    """
    work = Path(tempfile.mkdtemp(prefix=EVALUATE_SCRATCH, dir=run_dir))
    try:
        request = {**request, "work_dir": str(work), "result_file": str(work / EVALUATE_RESULT)}
        write_json_atomic(work / EVALUATE_REQUEST, request)
        cmd = [sys.executable, "-m", child, str(work / EVALUATE_REQUEST)]
        code = _run_child(
            cmd, BACKENDS[request["backend"]], run_dir / EVALUATE_LOG, work / EVALUATE_LOG, request.get("environment")
        )
        result = work / EVALUATE_RESULT
        if code != 0 or not result.is_file():
            raise LauncherError(
                f"evaluation of {run_dir.name} failed (the evaluation process exited with {code}; "
                f"its output: {run_dir / EVALUATE_LOG}); {EVALUATE_JSON} and {EVALUATE_MD} were left "
                "as they were",
                ExitCode.FAILED,
            )
        doc = build_document(request, json.loads(result.read_text(encoding="utf-8")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # counselling text: never more open than the test split it came from
    mode = Path(request["test_split"]["path"]).stat().st_mode & 0o666
    write_text_atomic(run_dir / EVALUATE_JSON, json.dumps(doc, indent=2, ensure_ascii=False) + "\n", mode)
    write_text_atomic(run_dir / EVALUATE_MD, render_markdown(doc), mode)
    if show:
        for p in doc["prompts"]:
            print(f"--- {p['id']} ({p['kind']}): {p['prompt']}")
            for name, answer in p["answers"].items():
                print(f"  [{name}] {answer['text']}")
    return doc
