"""A fake training rank for the reliability tests: real processes under the real torchrun, no model.

    FAKE_RANK_SPEC=spec.json python -m torch.distributed.run ... -m tests.support.fake_rank RUN_DIR

A run config selects it with ``launcher.entry: tests.support.fake_rank``; the supervisor passes its environment
on to torchrun and the ranks, so ``FAKE_RANK_SPEC`` (a JSON file) says how the ranks behave. The file is
read once at start; keys (all optional)::

    lines          training lines rank 0 appends to RUN_DIR/output/trainer_log.jsonl   (default 0)
    interval       seconds between lines                                                (default 0.2)
    total_steps    ``total_steps`` in each line                                        (default 100)
    eval_every     an eval line (``eval_loss``, no ``loss``) after every N-th step      (default 0: none)
    loaded_file    before the first line, wait until this file exists (a long model load)  (default: none)
    stall_after    after this many lines, write nothing until ``resume_file`` exists    (default: never)
    resume_file    the file that ends a stall
    then           what to do after the lines: exit | raise | kill | sleep              (default exit)
    exit_code      for ``exit``                                                         (default 0)
    message        for ``raise`` (a RuntimeError)
    kill_signal    for ``kill``: the rank sends itself this signal                      (default 9)
    ignore_sigterm SIGTERM is ignored (a rank stuck in a collective or a slow save)
    on_sighup      exit | ignore | default: ``exit`` writes a marker and exits 129
    quiet          print nothing (by default every rank prints a line per step, like a progress bar)
    first_step     the step of the first line (default 1; ``resume`` starts after the last checkpoint)
    checkpoints    write a small ``checkpoint-N`` folder (adapter, optimizer, trainer state) every N steps
    resume         start after the newest ``checkpoint-N`` in RUN_DIR/output, as a resumed trainer does
    save_on_stop   honour the launcher's save request as launcher/rank/stopsave.py does: announce it, and at the
                   next step end write ``checkpoint-N`` and ``stop_saved.json``, then exit 0
    ranks          {"1": {...}}: keys for one rank only, merged over the rest
    attempts       {"2": {...}}: keys for one attempt only (RUN_DIR/launch.json's ``attempt``), merged first

A trainer-log line the disk refuses is lost, not raised (LLaMA-Factory writes them from a worker thread
whose errors nobody sees).

Every rank writes RUN_DIR/fake_ranks/rank<N>.json (pid, process group, session) once it is set up, so a
test can find the processes it must check. Like ``launcher.entry``, an exception is recorded with
``launcher.rank.entry.write_error_file`` (RUN_DIR/errors/rank<N>.json) before it propagates.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from launcher.rank.entry import write_error_file
from launcher.state.runs import SAVE_DONE, SAVE_READY, SAVE_REQUEST
from tests.support.common import EMPTY_SAFETENSORS

SPEC_ENV = "FAKE_RANK_SPEC"
PIDS_DIR = "fake_ranks"


def load_spec(rank: int, attempt: int = 1) -> dict[str, Any]:
    path = os.environ.get(SPEC_ENV)
    spec = json.loads(Path(path).read_text()) if path else {}
    spec = {**spec, **spec.get("attempts", {}).get(str(attempt), {})}
    return {**spec, **spec.get("ranks", {}).get(str(rank), {})}


def attempt_of(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "launch.json").read_text()).get("attempt", 1))
    except (OSError, ValueError):
        return 1


def last_checkpoint_step(output: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in output.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    return max(steps, default=0)


def write_checkpoint(output: Path, step: int) -> None:
    """A small checkpoint folder that the launcher's checkpoint scan reads as complete (and exact)."""
    tmp = output / f"tmp-checkpoint-{step}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    (tmp / "adapter_config.json").write_text("{}")
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (tmp / "optimizer.pt").write_bytes(b"o")
    (tmp / "scheduler.pt").write_bytes(b"s")
    os.replace(tmp, output / f"checkpoint-{step}")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def progress_line(step: int, total: int, interval: float) -> dict[str, Any]:
    """A training line as LLaMA-Factory's LogCallback writes it."""
    elapsed, remaining = step * interval, (total - step) * interval
    return {
        "current_steps": step,
        "total_steps": total,
        "loss": round(3.0 / (1 + 0.1 * step), 4),
        "lr": 5e-5,
        "epoch": round(step / total, 4),
        "percentage": round(100.0 * step / total, 2),
        "elapsed_time": time.strftime("%H:%M:%S", time.gmtime(elapsed)),
        "remaining_time": time.strftime("%H:%M:%S", time.gmtime(remaining)),
    }


def eval_line(step: int, total: int) -> dict[str, Any]:
    return {
        "current_steps": step,
        "total_steps": total,
        "eval_loss": round(2.5 / (1 + 0.05 * step), 4),
        "epoch": round(step / total, 4),
        "percentage": round(100.0 * step / total, 2),
        "elapsed_time": "0:00:00",
        "remaining_time": "0:00:00",
    }


class SavedOnStop(Exception):  # noqa: N818
    pass


def write_progress(run_dir: Path, spec: dict[str, Any], rank: int) -> None:
    lines, interval = int(spec.get("lines", 0)), float(spec.get("interval", 0.2))
    total, eval_every = int(spec.get("total_steps", 100)), int(spec.get("eval_every", 0))
    stall_after = spec.get("stall_after")
    log = run_dir / "output" / "trainer_log.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    first = last_checkpoint_step(log.parent) + 1 if spec.get("resume") else int(spec.get("first_step", 1))
    every = int(spec.get("checkpoints", 0))
    if spec.get("save_on_stop") and rank == 0:
        _write_json(run_dir / SAVE_READY, {"pid": os.getpid(), "time": time.time()})
    while spec.get("loaded_file") and not Path(spec["loaded_file"]).exists():
        time.sleep(0.1)
    for step in range(first, lines + 1):
        if stall_after is not None and step == int(stall_after) + 1:
            while not Path(spec["resume_file"]).exists():
                time.sleep(0.1)
        time.sleep(interval)
        if not spec.get("quiet"):  # like a progress bar: every rank prints as it goes
            print(f"rank {rank} step {step}/{total}", flush=True)
        if rank != 0:  # like LLaMA-Factory: only the main process writes the trainer log
            continue
        records = [progress_line(step, total, interval)]
        if eval_every and step % eval_every == 0:
            records.append(eval_line(step, total))
        try:
            if every and step % every == 0:
                write_checkpoint(log.parent, step)
            with open(log, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
        except OSError:
            pass  # a full disk: this line is lost, training goes on
        if spec.get("save_on_stop") and (run_dir / SAVE_REQUEST).exists():
            if rank == 0:
                write_checkpoint(log.parent, step)
                _write_json(run_dir / SAVE_DONE, {"step": step, "path": f"output/checkpoint-{step}"})
            raise SavedOnStop


def _on_sighup(run_dir: Path, rank: int) -> None:
    def handler(_signum, _frame):
        _write_json(run_dir / PIDS_DIR / f"rank{rank}.sighup", {"pid": os.getpid(), "time": time.time()})
        os._exit(129)

    signal.signal(signal.SIGHUP, handler)


def run(run_dir: Path, spec: dict[str, Any], rank: int) -> int:
    if spec.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hup = spec.get("on_sighup", "default")
    if hup == "exit":
        _on_sighup(run_dir, rank)
    elif hup == "ignore":
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    pid = os.getpid()
    _write_json(
        run_dir / PIDS_DIR / f"rank{rank}.json",
        {"pid": pid, "pgid": os.getpgid(pid), "sid": os.getsid(pid), "rank": rank},
    )
    if not spec.get("quiet"):
        print(f"fake rank {rank} (pid {pid}) started", flush=True)
    try:
        write_progress(run_dir, spec, rank)
    except SavedOnStop:
        return 0
    then = spec.get("then", "exit")
    if then == "raise":
        raise RuntimeError(spec.get("message", f"fake rank {rank} failed on purpose"))
    if then == "kill":
        os.kill(pid, int(spec.get("kill_signal", signal.SIGKILL)))
        time.sleep(60)  # a caught or ignored signal must not look like a clean exit
        return 99
    if then == "sleep":
        while True:
            time.sleep(0.2)
    return int(spec.get("exit_code", 0))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0]).resolve()
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(run_dir, load_spec(rank, attempt_of(run_dir)), rank)
    except Exception as exc:
        write_error_file(run_dir, exc)
        raise


if __name__ == "__main__":
    sys.exit(main())
