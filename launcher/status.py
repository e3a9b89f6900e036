"""``launcher status``, ``list`` and ``logs``: read a run's record from the host, never needing the lock.

Works without torch (and imports neither pydantic nor rich, so a status answer costs little more
than the interpreter's start-up). The record is reconciled with the live system: a non-terminal run
whose supervisor is gone is ``SUPERVISOR_LOST`` (its surviving processes listed), one recorded on an
earlier boot is ``NODE_LOST``, and, where a Docker engine answers, a vanished container is
``NODE_LOST`` too. The trainer log is read from its end only; the best eval loss comes from the
supervisor's running summary.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .records import STATUS_FILE, TERMINAL, RunState, read_status
from .trainer_log import read_trainer_log_tail

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# A checkpoint is complete when the Trainer wrote its state last (after the weights).
CHECKPOINT_DONE = "trainer_state.json"


def last_complete_checkpoint(output: Path) -> dict[str, Any] | None:
    """The newest ``checkpoint-N`` folder holding weights and trainer state; partial ones are skipped."""
    try:
        entries = [(int(m.group(1)), p) for p in output.iterdir() if (m := CHECKPOINT.match(p.name)) and p.is_dir()]
    except OSError:
        return None
    for step, path in sorted(entries, reverse=True):
        has_weights = any((path / n).is_file() and (path / n).stat().st_size > 0
                          for n in ("adapter_model.safetensors", "model.safetensors"))  # fmt: skip
        if has_weights and (path / CHECKPOINT_DONE).is_file():
            exact = (path / "optimizer.pt").is_file() and (path / "scheduler.pt").is_file()
            return {"step": step, "path": str(path), "optimizer_state": exact}
    return None


def _parse_hms(text: Any) -> float | None:
    try:
        parts = [float(x) for x in str(text).split(":")]
    except ValueError:
        return None
    seconds = 0.0
    for part in parts:
        seconds = seconds * 60 + part
    return seconds


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
        return (datetime.now(timezone.utc) - datetime.fromisoformat(iso)).total_seconds()  # noqa: UP017
    except ValueError:
        return None


def _reconcile(status: dict[str, Any], run_dir: Path) -> tuple[str, list[dict[str, Any]], str | None]:
    """The state to show, the job's live processes, and a note on why the shown state differs."""
    from .procs import boot_id, find_live

    state = status.get("state", "PENDING")
    live = [r for r in status.get("processes", []) if find_live(r, str(run_dir))]
    if RunState(state) in TERMINAL:
        return state, live, None
    if status.get("boot_id") and boot_id() and status["boot_id"] != boot_id():
        return RunState.NODE_LOST.value, [], "the host rebooted since this run was recorded live"
    container = _container_state(status)
    if container == "missing":
        return RunState.NODE_LOST.value, live, f"container {status['container']} is gone"
    if not find_live(status.get("supervisor") or {}, "launcher"):
        note = "the supervisor is gone" + (
            f"; {len(live)} training process(es) still alive (`launcher stop` cleans them up)" if live else ""
        )
        return RunState.SUPERVISOR_LOST.value, live, note
    return state, live, None


def _container_state(status: dict[str, Any]) -> str | None:
    """The run's container state from the Docker engine, 'missing' if gone, None if unknown."""
    name = status.get("container")
    if not name:
        return None
    try:
        from docker.errors import DockerException, NotFound

        import docker
    except ImportError:
        return None
    try:
        client = docker.from_env(timeout=2)
        return client.containers.get(name).status
    except NotFound:
        return "missing"
    except DockerException:
        return None


def collect(run_dir: Path) -> dict[str, Any]:
    """Everything ``status`` shows, as one JSON-able dict. Raises ValueError for an unreadable record."""
    status = read_status(run_dir)
    state, live, note = _reconcile(status, run_dir)
    trainer_log = Path(status.get("trainer_log") or run_dir / "output" / "trainer_log.jsonl")
    tail = read_trainer_log_tail(trainer_log, count=16)
    summary = dict(status.get("progress") or {})
    progress = next((r for r in reversed(tail) if "current_steps" in r), {})
    last_loss = next((r for r in reversed(tail) if "loss" in r), {})
    last_eval = next((r for r in reversed(tail) if "eval_loss" in r), {})
    for record in tail:  # the tail may hold an eval newer than the supervisor's summary
        if "eval_loss" in record and (summary.get("best_eval_loss") is None
                                      or record["eval_loss"] < summary["best_eval_loss"]):  # fmt: skip
            summary["best_eval_loss"], summary["best_eval_step"] = record["eval_loss"], record["current_steps"]
    step, total = progress.get("current_steps"), progress.get("total_steps")
    elapsed = _since(status.get("started")) if status.get("ended") is None else None
    if status.get("started") and status.get("ended"):
        try:
            ended, started = datetime.fromisoformat(status["ended"]), datetime.fromisoformat(status["started"])
            elapsed = (ended - started).total_seconds()
        except ValueError:
            elapsed = None
    return {
        "run_id": status.get("run_id"),
        "state": state,
        "recorded_state": status.get("state"),
        "note": note,
        "attempt": status.get("attempt", 1),
        "smoke": status.get("smoke"),
        "pids": [r["pid"] for r in live],
        "supervisor_pid": (status.get("supervisor") or {}).get("pid"),
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
        "eta_s": _eta(progress, summary) if RunState(state) not in TERMINAL else None,
        "last_checkpoint": last_complete_checkpoint(trainer_log.parent),
        "exit_code": status.get("exit_code"),
        "signal": status.get("signal"),
        "failed_rank": status.get("failed_rank"),
        "reason": status.get("reason"),
        "run_dir": str(run_dir),
        "trainer_log": str(trainer_log),
        "container": status.get("container"),
    }


def _eta(progress: dict[str, Any], summary: dict[str, Any]) -> float | None:
    """Seconds left, from this attempt's own pace (LLaMA-Factory's remaining_time is wrong after a resume:
    its elapsed time restarts while the step count does not)."""
    step, total = progress.get("current_steps"), progress.get("total_steps")
    elapsed = _parse_hms(progress.get("elapsed_time"))
    first = summary.get("first_step")
    if step is None or not total or elapsed is None:
        return None
    done = step - (first - 1 if first is not None else 0)
    if done <= 0 or elapsed <= 0:
        return None
    return (total - step) * elapsed / done


def render(info: dict[str, Any]) -> str:
    def fmt(v: Any, spec: str = "") -> str:
        return "-" if v is None else format(v, spec)

    step = "-" if info["step"] is None else f"{info['step']}/{info['total_steps']} ({fmt(info['percent'])}%)"
    best = "-" if info["best_eval_loss"] is None else f"{info['best_eval_loss']:.4f} at step {info['best_eval_step']}"
    ckpt = info["last_checkpoint"]
    ckpt_text = "-" if not ckpt else f"step {ckpt['step']}: {ckpt['path']}" + (
        "" if ckpt["optimizer_state"] else " (adapter only)"
    )
    state = info["state"] + (f" (recorded {info['recorded_state']}: {info['note']})" if info["note"] else "")
    rows = [
        ("run", f"{info['run_id']} (attempt {info['attempt']}{', smoke' if info['smoke'] else ''})"),
        ("state", state),
        ("pids", ", ".join(map(str, info["pids"])) or "-"),
        ("step", step),
        ("epoch", fmt(info["epoch"], ".3f")),
        ("loss", fmt(info["loss"], ".4f")),
        ("eval loss", fmt(info["eval_loss"], ".4f")),
        ("best eval", best),
        ("lr", fmt(info["lr"], ".3g")),
        ("elapsed", _fmt_s(info["elapsed_s"])),
        ("eta", _fmt_s(info["eta_s"])),
        ("checkpoint", ckpt_text),
    ]
    if info["exit_code"] is not None or info["signal"] is not None:
        exit_text = f"code {info['exit_code']}" if info["signal"] is None else f"signal {info['signal']}"
        if rank := info.get("failed_rank"):  # torchrun exits 1; what the failing rank itself died of
            died = f"signal {rank['signal']}" if rank.get("signal") is not None else f"code {rank.get('exit_code')}"
            exit_text += f" (rank {rank.get('rank')}: {died})"
        rows.append(("exit", exit_text))
    if info["reason"]:
        rows.append(("reason", info["reason"].strip().splitlines()[-1]))
    rows += [("run dir", info["run_dir"]), ("trainer log", info["trainer_log"])]
    return "\n".join(f"{k:<12}{v}" for k, v in rows)


def list_runs(root: Path) -> list[Path]:
    try:
        runs = [p for p in root.iterdir() if (p / STATUS_FILE).is_file()]
    except OSError:
        return []
    return sorted(runs, key=lambda p: p.stat().st_mtime)


def show_status(run_dir: Path, as_json: bool, watch: float | None) -> int:
    while True:
        try:
            info = collect(run_dir)
        except ValueError as err:  # damaged record: one clear line, never a traceback
            print(str(err) if str(err).startswith("unreadable") else f"unreadable: {run_dir / STATUS_FILE} ({err})")
            return 1
        text = json.dumps(info, indent=2, default=str) if as_json else render(info)
        if watch is None:
            print(text)
            return 0
        sys.stdout.write("\x1b[2J\x1b[H" if sys.stdout.isatty() else "")
        print(text, flush=True)
        if RunState(info["state"]) in TERMINAL:
            return 0
        time.sleep(watch)


def show_list(root: Path) -> int:
    runs = list_runs(root)
    if not runs:
        print(f"no runs under {root}")
        return 0
    print(f"{'run':<40}{'state':<19}{'exit':<8}{'attempt':<9}{'created':<27}ended")
    for run_dir in runs:
        try:
            s = read_status(run_dir)
            code = s.get("exit_code")
            exit_text = f"sig {s['signal']}" if s.get("signal") else ("-" if code is None else str(code))
            print(f"{s.get('run_id', run_dir.name):<40}{s.get('state', '?'):<19}{exit_text:<8}"
                  f"{s.get('attempt', 1)!s:<9}{s.get('created', '-'):<27}{s.get('ended') or '-'}")  # fmt: skip
        except ValueError as err:
            print(f"{run_dir.name:<40}{err}")
    return 0


def show_logs(run_dir: Path, follow: bool, lines: int = 50, poll_s: float = 0.5) -> int:
    path = run_dir / "launcher.log"
    text = _tail_text(path, lines)
    sys.stdout.write(text)
    sys.stdout.flush()
    if not follow:
        return 0
    inode, offset = _stat(path)
    try:
        while True:
            time.sleep(poll_s)
            new_inode, size = _stat(path)
            if new_inode != inode or size < offset:  # recreated or truncated: start over
                inode, offset = new_inode, 0
            if size > offset:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read(size - offset)
                offset += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            if _ended(run_dir) and size == offset:
                return 0
    except KeyboardInterrupt:
        return 0


def _stat(path: Path) -> tuple[int | None, int]:
    try:
        st = os.stat(path)
        return st.st_ino, st.st_size
    except OSError:
        return None, 0


def _ended(run_dir: Path) -> bool:
    try:
        return RunState(read_status(run_dir)["state"]) in TERMINAL
    except (ValueError, KeyError):
        return False


def _tail_text(path: Path, lines: int, block: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - block))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:]) + "\n"
