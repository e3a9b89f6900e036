"""Duplicate launches: the run lock, and `start` racing against itself.

The fast tests hold the lock from a child process (a kernel flock) and kill it; the slow ones run the
real `launcher start` 16 times at once behind a barrier and then take the winner's supervisor away.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import yaml

from launcher.run.lock import LOCK_NAME, OWNER_NAME, LockBusy, RunLock, is_locked
from tests.support.common import REPO
from tests.support.fake_runs import (
    alive,
    events,
    fake_config,
    kill_all,
    launcher,
    processes_naming,
    rank_processes,
    read_status,
    recorded_processes,
    status_json,
    the_run_dir,
    wait_for,
    wait_for_growth,
)

HOLDER = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from launcher.run.lock import RunLock\n"
    "lock = RunLock(Path(sys.argv[1])).acquire()\n"
    "if len(sys.argv) > 2:\n"
    "    lock.describe(sys.argv[2], Path(sys.argv[1]) / sys.argv[2])\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def hold_lock():
    """Start processes that take the run lock of a root (optionally naming a run) and keep it."""
    holders: list[subprocess.Popen] = []

    def start(root: Path, run_id: str | None = None) -> subprocess.Popen:
        args = [sys.executable, "-c", HOLDER, str(root), *([run_id] if run_id else [])]
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True)
        holders.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in holders:
        proc.kill()
        proc.wait()


def minimal_config(tmp_path: Path) -> Path:
    """Enough of a config for `launcher start` to reach the lock (it validates the rest later)."""
    path = tmp_path / "minimal.yaml"
    data = {"launcher": {"output_root": str(tmp_path / "runs"), "smoke": True}, "model_name_or_path": str(tmp_path)}
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_held_lock_is_refused_at_once_naming_its_holder(tmp_path, hold_lock):
    root = tmp_path / "runs"
    holder = hold_lock(root, "demo-20261130-101500")
    started = time.monotonic()
    with pytest.raises(LockBusy) as info:
        RunLock(root).acquire()
    assert time.monotonic() - started < 0.5  # non-blocking
    message = str(info.value)
    assert "run demo-20261130-101500" in message and f"supervisor pid {holder.pid}" in message
    assert "`launcher stop demo-20261130-101500`" in message and str(root / LOCK_NAME) in message


def test_the_lock_is_free_after_its_holder_is_sigkilled_and_the_file_stays(tmp_path, hold_lock):
    root = tmp_path / "runs"
    holder = hold_lock(root)
    lock_file = root / LOCK_NAME
    inode = lock_file.stat().st_ino
    assert is_locked(root)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RunLock(root).acquire()  # no waiting, no cleanup step: the kernel dropped the flock
    assert lock.held
    lock.release()
    assert lock_file.exists() and lock_file.stat().st_ino == inode  # never deleted or replaced
    assert not is_locked(root)
    assert lock_file.exists()


def test_owner_identity_is_written_right_after_acquiring(tmp_path, hold_lock):
    """A stale owner file of an earlier run must not be named while a new holder validates its config."""
    root = tmp_path / "runs"
    root.mkdir()
    (root / OWNER_NAME).write_text(json.dumps({"pid": 1, "create_time": 0.0, "run_id": "old-run-20261129-000000"}))
    holder = hold_lock(root)
    owner = json.loads((root / OWNER_NAME).read_text())
    assert owner["pid"] == holder.pid and owner["run_id"] is None
    assert abs(owner["create_time"] - psutil.Process(holder.pid).create_time()) < 0.5
    assert {"boot_id", "hostname", "since", "cmdline"} <= owner.keys()
    with pytest.raises(LockBusy) as info:
        RunLock(root).acquire()
    assert "old-run" not in str(info.value)
    assert f"a run being set up (supervisor pid {holder.pid}" in str(info.value)


def test_start_refuses_before_loading_the_training_stack_while_the_lock_is_held(tmp_path, hold_lock):
    """What makes the refusal quick (well under a second where the machine is idle): it comes before torch,
    transformers or LLaMA-Factory are imported. Shown without a clock: those packages are shadowed by ones that
    refuse to import, so a refusal that loaded any of them would end in a traceback."""
    import os

    from tests.support.common import REPO

    cfg = minimal_config(tmp_path)
    hold_lock(tmp_path / "runs", "demo-20261130-101500")
    blocked = tmp_path / "blocked"
    for name in ("torch", "transformers", "llamafactory"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} imported by a refused start')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), str(REPO)])}
    proc = launcher("start", cfg, env=env, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "another run is live: run demo-20261130-101500" in proc.stderr
    assert "Traceback" not in proc.stderr and "imported by a refused start" not in proc.stderr
    assert not any(p.is_dir() for p in (tmp_path / "runs").iterdir())


# --- the real `start`, racing ------------------------------------------------------------------------

RACERS = 16


@pytest.fixture(scope="module")
def contested_run(tmp_path_factory, demo_assets):
    """16 `launcher start` of one config at once, behind a barrier; the ranks of the winner keep going
    (each prints a line per step, like a progress bar) until they are stopped."""
    tmp = tmp_path_factory.mktemp("contested")
    spec = {"lines": 100000, "interval": 0.3, "then": "sleep"}
    cfg, env = fake_config(tmp, demo_assets, spec, nproc_per_node=2, stop_grace_s=5)
    root = tmp / "runs"
    root.mkdir()
    # an earlier run's owner file: no refusal may name it as the live run
    (root / OWNER_NAME).write_text(json.dumps({"pid": 1, "create_time": 0.0, "run_id": "old-run-20261129-000000"}))
    barrier = threading.Barrier(RACERS)
    results: list[subprocess.CompletedProcess | None] = [None] * RACERS

    def race(i: int) -> None:
        barrier.wait()
        results[i] = launcher("start", cfg, env=env, timeout=600)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run = SimpleNamespace(cfg=cfg, env=env, root=root, results=results, tmp=tmp)
    yield run
    kill_all(processes_naming(str(tmp)))


@pytest.mark.slow
def test_sixteen_concurrent_starts_make_exactly_one_run(contested_run):
    results = contested_run.results
    codes = sorted(p.returncode for p in results)
    assert codes == [0] + [3] * (RACERS - 1), [(p.returncode, p.stderr[-300:]) for p in results]
    for proc in results:
        if proc.returncode == 3:
            assert "another run is live" in proc.stderr and "old-run" not in proc.stderr, proc.stderr
    run_dir = the_run_dir(contested_run.root)
    winner = next(p for p in results if p.returncode == 0)
    assert f"started run {run_dir.name}" in winner.stdout
    supervisors = processes_naming(f"_supervise {contested_run.cfg}")
    assert len(supervisors) == 1, [p.cmdline() for p in supervisors]
    assert supervisors[0].pid == read_status(run_dir)["supervisor"]["pid"]
    # refused supervisors leave nothing behind in the runs folder
    assert sorted(p.name for p in contested_run.root.iterdir()) == sorted(
        [run_dir.name, "launcher.lock", "launcher.lock.owner.json"]
    )


@pytest.mark.slow
def test_a_second_start_is_refused_naming_the_live_run(contested_run):
    """Refused before the training stack loads (``test_start_refuses_before_loading_the_training_stack...``)."""
    run_dir = the_run_dir(contested_run.root)
    tries = [launcher("start", contested_run.cfg, env=contested_run.env, timeout=60) for _ in range(3)]
    for proc in tries:
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert f"another run is live: run {run_dir.name}" in proc.stderr
        assert f"`launcher stop {run_dir.name}`" in proc.stderr
    the_run_dir(contested_run.root)  # still exactly one


@pytest.mark.slow
def test_status_works_while_the_lock_is_held(contested_run):
    run_dir = the_run_dir(contested_run.root)
    ranks = rank_processes(run_dir, 2)
    assert is_locked(contested_run.root)

    def running_with_progress():
        info = status_json(run_dir)
        return info if info["state"] == "RUNNING" and info["step"] else None

    info = wait_for("the run to be RUNNING with progress", running_with_progress)
    assert info["run_id"] == run_dir.name
    assert {read_status(run_dir)["job_pid"], *(p.pid for p in ranks)} <= set(info["pids"])
    listed = launcher("list", "--root", contested_run.root)
    assert listed.returncode == 0 and run_dir.name in listed.stdout and "RUNNING" in listed.stdout


@pytest.mark.slow
def test_supervisor_sigkilled_then_stop_cleans_up(contested_run):
    root, env = contested_run.root, contested_run.env
    run_dir = the_run_dir(root)
    ranks = rank_processes(run_dir, 2)
    status = read_status(run_dir)
    supervisor = psutil.Process(status["supervisor"]["pid"])
    torchrun = psutil.Process(status["job_pid"])
    lock_inode = (root / LOCK_NAME).stat().st_ino

    supervisor.send_signal(signal.SIGKILL)
    wait_for("the supervisor to die", lambda: not alive(supervisor), timeout=10)
    # the kernel released the lock with the process; the file itself is still there
    wait_for("the lock to be free", lambda: not is_locked(root), timeout=5)
    assert (root / LOCK_NAME).stat().st_ino == lock_inode

    # the orphaned job keeps training: its ranks print a line per step, and nothing breaks
    wait_for_growth(run_dir / "output" / "trainer_log.jsonl", lines=3)
    assert all(alive(p) for p in [torchrun, *ranks]), "the job died with its supervisor"

    info = status_json(run_dir, env)
    assert info["state"] == "SUPERVISOR_LOST" and info["recorded_state"] == "RUNNING"
    assert {torchrun.pid, *(p.pid for p in ranks)} <= set(info["pids"])
    shown = launcher("status", run_dir, env=env)
    assert "SUPERVISOR_LOST" in shown.stdout and "`launcher stop` cleans them up" in shown.stdout
    for pid in (torchrun.pid, *(p.pid for p in ranks)):
        assert str(pid) in shown.stdout

    # the lock is free, but the orphaned job still blocks a new start
    refused = launcher("start", contested_run.cfg, env=env, timeout=300)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "still has live training processes" in refused.stderr
    assert f"`launcher stop {run_dir.name}`" in refused.stderr
    the_run_dir(root)

    stopped = launcher("stop", run_dir, "--grace", "2", env=env, timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    wait_for("every process of the job to end", lambda: not any(alive(p) for p in [torchrun, *ranks]), timeout=20)
    assert recorded_processes(run_dir) == []
    status = read_status(run_dir)
    assert status["state"] == "SUPERVISOR_LOST" and "`launcher stop` stopped" in status["reason"]
    assert events(run_dir)[-1]["event"] == "cleanup"
    assert (root / LOCK_NAME).exists()
    assert os.path.exists(run_dir / "status.json")
