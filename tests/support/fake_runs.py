"""Helpers for the reliability tests: runs of the real launcher whose ranks are ``tests.support.fake_rank``.

Everything is real except the model: the ``launcher`` CLI in child processes, the supervisor (detached
by ``start`` or in the foreground with ``run``), the config validation by LLaMA-Factory's parser,
torchrun, one process per rank, signals and files. ``fake_config`` writes a valid demo config whose
``launcher.entry`` is ``tests.support.fake_rank`` and the rank behaviour file it reads (see tests/support/fake_rank.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from launcher.files import write_json_atomic
from launcher.run.placement import reconcile
from launcher.run.resume import ResumePlan, plan_resume
from launcher.state.procs import boot_id, identity
from launcher.state.record import SCHEMA_VERSION, RunRecord, read_record
from launcher.state.states import RunState
from tests.support.common import REPO, make_config

# The kernel check runs a DeltaNet forward/backward in a child process (tens of seconds on this CPU);
# these tests are about supervision, and the demo's preflight rows that matter here still run.
PREFLIGHT_SKIP = "kernel"


def fake_config(
    tmp_path: Path, demo_assets: dict[str, Path], spec: dict[str, Any], **launcher: Any
) -> tuple[Path, dict[str, str]]:
    """A run config whose ranks are fake, and the environment that tells them what to do."""
    settings = {"entry": "tests.support.fake_rank", "nproc_per_node": 1, "stall_minutes": 10.0, "stop_grace_s": 10.0}
    cfg = make_config(tmp_path, demo_assets, launcher={**settings, **launcher})
    return cfg, fake_env(tmp_path, spec)


def fake_env(tmp_path: Path, spec: dict[str, Any]) -> dict[str, str]:
    """The environment for a launcher (or a bare torchrun) whose fake ranks behave as ``spec`` says."""
    spec_path = tmp_path / "fake_rank.json"
    spec_path.write_text(json.dumps(spec))
    return {
        **os.environ,
        "FAKE_RANK_SPEC": str(spec_path),
        "LAUNCHER_PREFLIGHT_SKIP": PREFLIGHT_SKIP,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }


def launcher(*args: Any, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m launcher ARGS`` to its end; ``.elapsed`` holds its wall time."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    proc.elapsed = time.monotonic() - started  # type: ignore[attr-defined]
    return proc


def launcher_bg(*args: Any, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start ``python -m launcher ARGS`` in its own session (a stand-in for a container's main process)."""
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115  (the child keeps it)
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", *map(str, args)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


# what a check may raise while files are being written and processes end: polled again
TRANSIENT: tuple[type[Exception], ...] = (OSError, ValueError, KeyError)


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float = 120,
    every: float = 0.2,
    tolerate: tuple[type[Exception], ...] = TRANSIENT,
) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds. An
    exception in ``tolerate`` counts as not yet; any other fails at once (``tolerate=()``: every one does)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except tolerate as err:
            last = err
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def fill_disk(path: Path) -> None:
    """Write ``path`` until its disk refuses another byte (a real full disk, to the last byte)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (1 << 20, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"x" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)


def spawn(args: list[str], marker: str, **popen: Any) -> subprocess.Popen:
    """Start ``args`` and return once the new process runs them (its command line names ``marker``): right
    after ``Popen`` the child may not have exec'd yet and still shows its parent's command line."""
    proc = subprocess.Popen(args, **popen)
    wait_for(
        f"process {proc.pid} to run {marker!r}",
        lambda: marker in " ".join(psutil.Process(proc.pid).cmdline()),
        timeout=60,
    )
    return proc


def wait_for_growth(path: Path, lines: int = 2, timeout: float = 120) -> None:
    """Wait until ``path`` gains ``lines`` more newline-ended lines than it has now (the writer is alive)."""
    start = path.read_bytes().count(b"\n") if path.exists() else 0
    wait_for(f"{lines} new line(s) in {path}", lambda: path.read_bytes().count(b"\n") >= start + lines, timeout)


def write_record(run_dir: Path, run_id: str = "run", **fields: Any) -> Path:
    """Write a ``status.json`` holding ``fields`` as the launcher would, without going through transitions
    (a crafted record in any state, for the readers under test)."""
    if isinstance(fields.get("state"), str):
        fields["state"] = RunState(fields["state"])
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "status.json", RunRecord(run_id=run_id, run_dir=str(run_dir), **fields).to_dict())
    return run_dir


def read_status(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "status.json").read_text())


def status_json(run_dir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """What ``launcher status RUN --json`` answers (the host-side view, reconciled with live processes)."""
    proc = launcher("status", run_dir, "--json", env=env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_story(run_dir: Path, lines: int = 40) -> str:
    """What a failed assertion should show about a run: its end reason, the ranks' error records and the last
    lines the job printed (a test that fails on a loaded CI machine then says why)."""
    record = read_status(run_dir) if (run_dir / "status.json").exists() else {}
    errors = sorted((run_dir / "errors").glob("rank*.json")) if (run_dir / "errors").is_dir() else []
    log = run_dir / "launcher.log"
    tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
    parts = [
        f"state {record.get('state')}, exit code {record.get('exit_code')}, signal {record.get('signal')}, "
        f"reason: {record.get('reason')}"
    ]
    parts += [f"{path.name}: {json.loads(path.read_text()).get('traceback', '')[-1500:]}" for path in errors]
    parts += ["last lines of the job's output:", *tail]
    return "\n".join(parts)


def the_run_dir(root: Path) -> Path:
    runs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    assert len(runs) == 1, f"expected exactly one run folder in {root}, found {runs}"
    return runs[0]


def wait_for_run_dir(root: Path, timeout: float = 180) -> Path:
    def found() -> Path | None:
        return next((p for p in root.iterdir() if (p / "status.json").exists()), None)

    return wait_for(f"a run folder with status.json under {root}", found, timeout)


def rank_processes(run_dir: Path, nproc: int, timeout: float = 120) -> list[psutil.Process]:
    """The live fake ranks of a run, once each has reported in (and the supervisor has recorded them)."""
    folder = run_dir / "fake_ranks"
    wait_for(
        f"{nproc} fake rank(s) to start in {folder}", lambda: len(list(folder.glob("rank*.json"))) >= nproc, timeout
    )
    procs = [psutil.Process(json.loads((folder / f"rank{r}.json").read_text())["pid"]) for r in range(nproc)]
    wait_for(
        "the supervisor to record the ranks in status.json",
        lambda: {p.pid for p in procs} <= {r["pid"] for r in read_status(run_dir).get("processes", [])},
        timeout,
    )
    return procs


def recorded_processes(run_dir: Path) -> list[psutil.Process]:
    """Every process status.json names (supervisor, torchrun, ranks) that is alive now, as psutil handles
    (``is_running`` then also guards against pid reuse)."""
    status = read_status(run_dir)
    found = []
    for record in [status.get("supervisor") or {}, *status.get("processes", [])]:
        try:
            proc = psutil.Process(record["pid"])
        except (psutil.NoSuchProcess, KeyError):
            continue
        if abs(proc.create_time() - record["create_time"]) < 0.5 and alive(proc):
            found.append(proc)
    return found


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_all(procs: list[psutil.Process]) -> None:
    """Test cleanup: SIGKILL whatever is still alive of ``procs``."""
    for proc in procs:
        try:
            if proc.is_running():
                proc.kill()
        except psutil.NoSuchProcess:
            pass


def processes_naming(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``text`` (e.g. a run's config path)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if text in " ".join(proc.info["cmdline"] or []) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


RUN_ID = "r-20261130-101500"


def crafted_run(tmp_path: Path, name: str = RUN_ID, **fields) -> Path:
    """A run folder whose status.json says what ``fields`` say (a dead supervisor by default)."""
    run_dir = tmp_path / "runs" / name
    (run_dir / "output").mkdir(parents=True)
    dead = spawn([sys.executable, "-c", "import time; time.sleep(60)", "launcher", "_supervise"], "_supervise")
    dead_identity = identity(psutil.Process(dead.pid))
    dead.kill()
    dead.wait()
    status = {
        "schema": SCHEMA_VERSION,
        "run_id": name,
        "run_dir": str(run_dir),
        "state": "RUNNING",
        "created": "2026-11-30T10:15:00+00:00",
        "started": "2026-11-30T10:15:05+00:00",
        "attempt": 1,
        "boot_id": boot_id(),
        "supervisor": dead_identity,
        "processes": [],
        "exit_code": None,
        "signal": None,
        "reason": None,
        "ended": None,
        "trainer_log": str(run_dir / "output" / "trainer_log.jsonl"),
        **fields,
    }
    (run_dir / "status.json").write_text(json.dumps(status))
    return run_dir


def planned_resume(run_dir: Path, adapter_only: bool) -> ResumePlan:
    """``launcher resume``'s plan for ``run_dir``, its record held against the live system by its placement."""
    return plan_resume(run_dir, reconcile(read_record(run_dir), run_dir), adapter_only)
