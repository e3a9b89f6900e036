"""``launcher status``, ``list`` and ``logs``: read a run's record from the host, never needing the lock.

Works without torch (and imports neither pydantic nor rich, so a status answer costs little more
than the interpreter's start-up). The record is reconciled with the live system
by its placement (``launcher.run.placement``); the trainer log is read from its end only; the best eval loss comes
from the supervisor's running summary.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from launcher.checks.kernels.choice import summary as kernel_summary
from launcher.errors import ExitCode
from launcher.files import FileFollower, read_json_object, shown, tail_lines
from launcher.rank.oomtrack import summary
from launcher.run.placement import placement_of
from launcher.state.checkpoints import scan_checkpoints
from launcher.state.record import RecordUnreadable, RunRecord, parse_time, read_record
from launcher.state.runs import (
    CHECKPOINT_FOLDER,
    JOB_LOG,
    OUTPUT_SUBDIR,
    PREFLIGHT_FILE,
    SUPERVISOR_LOG,
    TRAINER_LOG,
    TRAINER_STATE,
    list_runs,
    unrecorded_runs,
)
from launcher.state.states import RunState
from launcher.state.trainer_log import MAX_LINE_BYTES, read_tail


def _parse_hms(text: Any) -> float | None:
    """LLaMA-Factory's ``elapsed_time`` is ``str(timedelta)``: ``H:MM:SS``, past a day ``2 days, H:MM:SS``; None
    for anything else (``"inf"``, ``"nan"``: a float() would take them)."""
    days, _, hms = str(text).rpartition(", ")
    try:
        seconds = float(days.split()[0]) * 86400 if days else 0.0
        clock = 0.0
        for part in hms.split(":"):
            clock = clock * 60 + float(part)
    except (ValueError, IndexError):
        return None
    total = seconds + clock
    return total if math.isfinite(total) else None


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{h}:{m:02d}:{s:02d}"


def _since(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return (datetime.now(timezone.utc) - parse_time(iso)).total_seconds()  # noqa: UP017
    except ValueError:
        return None


def collect(run_dir: Path) -> dict[str, Any]:
    """Everything ``status`` shows, as one JSON-able dict.

    Raises:
        RecordUnreadable: the record is missing, damaged or of a newer schema.
    """
    record = read_record(run_dir)
    placement = placement_of(record)
    seen = placement.reconcile(run_dir)
    trainer_log = record.resolve(run_dir, record.trainer_log) or run_dir / OUTPUT_SUBDIR / TRAINER_LOG
    read = read_tail(trainer_log, count=16)
    tail = read.records
    summary = dict(record.progress)
    progress = next((r for r in reversed(tail) if "current_steps" in r), {})
    last_loss = next((r for r in reversed(tail) if "loss" in r), {})
    last_eval = next((r for r in reversed(tail) if "eval_loss" in r), {})
    for line in tail:  # the tail may hold an eval newer than the supervisor's summary
        if "eval_loss" in line and (
            summary.get("best_eval_loss") is None or line["eval_loss"] < summary["best_eval_loss"]
        ):
            summary["best_eval_loss"], summary["best_eval_step"] = line["eval_loss"], line["current_steps"]
    step, total = progress.get("current_steps"), progress.get("total_steps")
    trained = next((r for r in reversed(tail) if "loss" in r and "current_steps" in r), {})
    pace = _pace(trained, record, run_dir)
    elapsed = _since(record.started) if record.ended is None else None
    if record.started and record.ended:
        try:
            elapsed = (parse_time(record.ended) - parse_time(record.started)).total_seconds()
        except ValueError:
            elapsed = None
    # complete by its files; not read for damage (a day-long run's trainer state is megabytes, and `--watch` asks
    # every few seconds): `resume` reads them and says what it skips
    checkpoint = (scan_checkpoints(trainer_log.parent)[0] or [None])[-1]
    return {
        "run_id": record.run_id,
        "state": seen.state.value,
        "recorded_state": record.state.value,
        "note": seen.note,
        "liveness": seen.liveness,
        "attempt": record.attempt,
        "smoke": record.smoke,
        "pids": seen.live_pids,
        "devices": [f"{d.get('host_index')} ({d.get('identity')})" for d in record.devices],
        "supervisor_pid": (record.supervisor or {}).get("pid"),
        "step": step,
        "total_steps": total,
        "percent": round(100.0 * step / total, 1) if step is not None and total else None,
        "epoch": progress.get("epoch"),
        "loss": last_loss.get("loss"),
        "eval_loss": last_eval.get("eval_loss", summary.get("eval_loss")),
        "best_eval_loss": summary.get("best_eval_loss"),
        "best_eval_step": summary.get("best_eval_step"),
        "lr": last_loss.get("lr"),
        "elapsed_s": elapsed,
        "eta_s": _eta(progress, pace) if not seen.state.terminal else None,
        "pace": pace,
        "last_checkpoint": None
        if checkpoint is None
        else {"step": checkpoint.step, "path": str(checkpoint.path), "optimizer_state": checkpoint.optimizer_state},
        "exit_code": record.exit_code,
        "signal": record.signal,
        "run_exit_code": record.run_exit_code,
        "stop_signal": record.stop_signal,
        "stopped_by": record.stopped_by,
        "saved_checkpoint": record.saved_checkpoint,
        "attempts": record.attempts,
        "record_write_failures": record.record_write_failures,
        "failed_rank": record.failed_rank,
        "out_of_memory": record.out_of_memory,
        "reason": record.reason,
        "run_dir": str(run_dir),
        "trainer_log": str(trainer_log),
        "trainer_log_long_lines_skipped": read.long_lines_skipped,
        "container": record.container,
        "container_state": seen.container_state,
        "slurm": record.slurm,
        **placement.status_fields(seen),
        "kernel_choice": kernel_choice(run_dir),
    }


def kernel_choice(run_dir: Path) -> dict[str, Any] | None:
    """Preflight's kernel choice on NPU (``preflight.json``), or None where it made none."""
    found = read_json_object(run_dir / PREFLIGHT_FILE)
    return found.get("kernel_choice") if isinstance(found, dict) else None


_CHECKPOINT_STEP = re.compile(CHECKPOINT_FOLDER.format(step=r"(\d+)") + "/*$")


def _resume_point(record: RunRecord, run_dir: Path) -> tuple[int, int | None] | None:
    """The step this attempt continued from and the input tokens seen by then (None: not known), from the
    checkpoint it resumed from (its ``trainer_state.json``); ``(0, 0)`` for an attempt that started afresh.
    None when the record does not say which step."""
    if not record.resumed_from:
        return 0, 0
    found = _CHECKPOINT_STEP.search(record.resumed_from)
    if not found:
        return None
    folder = record.resolve(run_dir, record.resumed_from)
    state = read_json_object(folder / TRAINER_STATE) if folder else None
    tokens = state.get("num_input_tokens_seen") if isinstance(state, dict) else None
    return int(found.group(1)), tokens if isinstance(tokens, int) else None


def _pace(line: dict[str, Any], record: RunRecord, run_dir: Path) -> dict[str, Any] | None:
    """This attempt's pace from its resume point: seconds per step and, when the log counts tokens, tokens/s.

    LLaMA-Factory's own figures are wrong after a resume: its ``elapsed_time`` restarts with the attempt
    while ``current_steps`` and ``total_tokens`` continue from the checkpoint, so its ``remaining_time``
    and ``throughput`` count the steps and tokens of earlier attempts against this attempt's time. Here
    both are counted from the resume point. ``line`` is the newest training line of the trainer log.
    """
    point = _resume_point(record, run_dir)
    step, elapsed = line.get("current_steps"), _parse_hms(line.get("elapsed_time"))
    first = (record.progress or {}).get("first_step")
    if point is None or step is None or elapsed is None or elapsed <= 0:
        return None
    since, tokens_then = point
    if step <= since or (since and (first is None or first <= since)):  # a line of an earlier attempt
        return None
    pace: dict[str, Any] = {
        "since_step": since,
        "steps": step - since,
        "elapsed_s": elapsed,
        "s_per_step": elapsed / (step - since),
        "tokens_per_s": None,
    }
    tokens = line.get("total_tokens")
    if isinstance(tokens, (int, float)) and tokens_then is not None and tokens >= tokens_then:
        pace["tokens_per_s"] = (tokens - tokens_then) / elapsed
    return pace


def _eta(progress: dict[str, Any], pace: dict[str, Any] | None) -> float | None:
    """Seconds left, at this attempt's own pace (see ``_pace``; LLaMA-Factory's ``remaining_time`` is wrong
    after a resume)."""
    step, total = progress.get("current_steps"), progress.get("total_steps")
    if step is None or not total or pace is None:
        return None
    return max(0, total - step) * pace["s_per_step"]


def _fmt_pace(pace: dict[str, Any] | None) -> str:
    if pace is None:
        return "-"
    text = f"{pace['s_per_step']:.3g} s/step"
    if pace["tokens_per_s"] is not None:
        text += f", {pace['tokens_per_s']:,.0f} tokens/s"
    return text + f" ({pace['steps']} step(s) in {_fmt_s(pace['elapsed_s'])} since step {pace['since_step']})"


def render(info: dict[str, Any]) -> str:
    def fmt(v: Any, spec: str = "") -> str:
        return "-" if v is None else format(v, spec)

    step = "-" if info["step"] is None else f"{info['step']}/{info['total_steps']} ({fmt(info['percent'])}%)"
    best = "-" if info["best_eval_loss"] is None else f"{info['best_eval_loss']:.4f} at step {info['best_eval_step']}"
    ckpt = info["last_checkpoint"]
    ckpt_text = (
        "-"
        if not ckpt
        else f"step {ckpt['step']}: {ckpt['path']}" + ("" if ckpt["optimizer_state"] else " (adapter only)")
    )
    state = info["state"] + (f" (recorded {info['recorded_state']}: {info['note']})" if info["note"] else "")
    rows = [
        ("run", f"{info['run_id']} (attempt {info['attempt']}{', smoke' if info['smoke'] else ''})"),
        ("state", state),
        ("pids", ", ".join(map(str, info["pids"])) or "-"),
        *([("devices", ", ".join(info["devices"]))] if info.get("devices") else []),
        ("step", step),
        ("epoch", fmt(info["epoch"], ".3f")),
        ("loss", fmt(info["loss"], ".4f")),
        ("eval loss", fmt(info["eval_loss"], ".4f")),
        ("best eval", best),
        ("lr", fmt(info["lr"], ".3g")),
        ("elapsed", _fmt_s(info["elapsed_s"])),
        ("pace", _fmt_pace(info.get("pace"))),
        ("eta", _fmt_s(info["eta_s"])),
        ("checkpoint", ckpt_text),
    ]
    if info["exit_code"] is not None or info["signal"] is not None:
        exit_text = f"code {info['exit_code']}" if info["signal"] is None else f"signal {info['signal']}"
        if rank := info.get("failed_rank"):  # torchrun exits 1; what the failing rank itself died of
            died = f"signal {rank.get('signal')}" if rank.get("signal") is not None else f"code {rank.get('exit_code')}"
            exit_text += f" (rank {rank.get('rank')}: {died})"
        if info.get("run_exit_code") is not None and info["state"] in ("CANCELLED", "TERMINATED"):
            exit_text = f"{info['run_exit_code']} (128 + signal {info['stop_signal']}); the job's own: {exit_text}"
        rows.append(("exit", exit_text))
    if info.get("stopped_by"):
        rows.append(("stopped by", info["stopped_by"]))
    if saved := info.get("saved_checkpoint"):
        rows.append(("saved", f"step {saved.get('step')} on the stop: {saved.get('path')}"))
    for a in info.get("attempts") or []:  # earlier attempts, restarted automatically (launcher.restart)
        lost = f"resumed from step {a.get('resumed_step')}, {a.get('steps_lost')} step(s) lost"
        rows.append((f"attempt {a.get('attempt')}", f"{a.get('state')}: {a.get('cause')}; {lost}"))
    for f in info.get("record_write_failures") or []:
        until = f.get("until") or "still failing"
        failed = f"{f.get('failed_writes')} write(s) failed {f.get('since')} .. {until}"
        rows.append(("record", f"{failed}: {f.get('error')}"))
    if oom := info.get("out_of_memory"):  # the phase, step and layer the rank ran out of memory in, and the fix
        rows.append(("memory", f"rank {oom.get('rank')}: {summary(oom)}"))
        if oom.get("snapshot"):
            rows.append(("snapshot", f"{oom['snapshot']} (open it in https://pytorch.org/memory_viz)"))
    if info["reason"] and info["reason"].strip():
        rows.append(("reason", info["reason"].strip().splitlines()[-1]))
    if info.get("container_name"):  # what the placement says of a container the run lives in
        rows.append(("container", f"{info['container_name']} ({info['container_status']})"))
    if info.get("slurm_status"):
        rows.append(("slurm", info["slurm_status"]))
    if info.get("kernel_choice"):  # which kernel each DeltaNet component got on NPU, and what preflight refused
        rows.append(("kernels", kernel_summary(info["kernel_choice"])))
    log = info["trainer_log"]
    if skipped := info.get("trainer_log_long_lines_skipped"):
        log += f" ({skipped} line(s) over {MAX_LINE_BYTES:,} bytes skipped: damaged)"
    rows += [("run dir", info["run_dir"]), ("trainer log", log)]
    # every value may hold text from outside (a sender's command line, an exception, a path): one row each
    return "\n".join(f"{k:<12}{shown(v)}" for k, v in rows)


def show_status(run_dir: Path, as_json: bool, watch: float | None) -> int:
    while True:
        info = collect(run_dir)  # RecordUnreadable: one clear line from the CLI, never a traceback
        text = json.dumps(info, indent=2, default=str) if as_json else render(info)
        if watch is None:
            print(text)
            return ExitCode.OK
        sys.stdout.write("\x1b[2J\x1b[H" if sys.stdout.isatty() else "")
        print(text, flush=True)
        if RunState(info["state"]).terminal:
            return ExitCode.OK
        time.sleep(watch)


def show_list(root: Path) -> int:
    runs = list_runs(root)
    runs += unrecorded_runs(root)  # each a row saying why its record cannot be read
    if not runs:
        print(f"no runs under {root}")
        return ExitCode.OK
    print(f"{'run':<40}{'state':<19}{'exit':<8}{'attempt':<9}{'created':<27}ended")
    for run_dir in runs:
        try:
            r = read_record(run_dir)
        except RecordUnreadable as err:
            print(f"{shown(run_dir.name):<40}{err}")
            continue
        state = placement_of(r).reconcile(run_dir).state.value
        exit_text = f"sig {r.signal}" if r.signal else ("-" if r.exit_code is None else str(r.exit_code))
        if r.run_exit_code is not None:  # what `launcher run` returned (128 + signal for a stop)
            exit_text = str(r.run_exit_code)
        print(shown(f"{r.run_id:<40}{state:<19}{exit_text:<8}{r.attempt!s:<9}{r.created:<27}{r.ended or '-'}"))
    return ExitCode.OK


def show_leases() -> int:
    """``launcher list --devices``: the device leases held on this host (state/lease.py), one row per device."""
    from launcher.state.lease import lease_dir, list_leases

    folder = lease_dir()
    held = list_leases(folder)
    if not held:
        print(f"no device is leased on this host ({folder})")
        return ExitCode.OK
    print(f"{'device':<10}{'identity':<46}{'run':<36}{'user':<12}{'since':<27}runs folder")
    for lease in held:
        row = (
            f"{lease.get('host_index', '?')!s:<10}{lease.get('device', '?')!s:<46}"
            f"{lease.get('run_id') or 'being set up'!s:<36}{lease.get('user', '?')!s:<12}"
            f"{lease.get('since', '?')!s:<27}{lease.get('runs_root', '?')}"
        )
        print(shown(row + (f"  ({lease['note']})" if lease.get("note") else "")))
    return ExitCode.OK


def show_logs(run_dir: Path, follow: bool, lines: int = 50, poll_s: float = 0.5) -> int:
    """The end of the job's log (``-f``: and what follows, until the run ends). Before the job started, and
    for a run whose job never started (a refused preflight), the detached supervisor's own log."""
    job_log, own_log = run_dir / JOB_LOG, run_dir / SUPERVISOR_LOG
    path = job_log if job_log.exists() or not own_log.exists() else own_log
    if path == own_log:
        print(f"(the job has not written {JOB_LOG}; this is the supervisor's own output, {SUPERVISOR_LOG})")
    sys.stdout.write(tail_lines(path, lines))
    sys.stdout.flush()
    if not follow:
        return ExitCode.OK
    follower = FileFollower(path, offset=_size(path))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two reads
    try:
        while True:
            ended = _ended(run_dir)  # checked before the read: once ended, this read sees the last bytes
            chunk, _ = follower.read_new()
            if chunk:
                sys.stdout.write(decoder.decode(chunk))
                sys.stdout.flush()
            elif path == own_log and job_log.exists():  # the job started: follow its log from here on
                print(f"(the job started: following {JOB_LOG})", flush=True)
                follower.close()
                path, follower = job_log, FileFollower(job_log)
            elif ended:
                return ExitCode.OK
            else:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        return ExitCode.OK
    finally:
        follower.close()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _ended(run_dir: Path) -> bool:
    try:
        return read_record(run_dir).terminal
    except RecordUnreadable:
        return False
