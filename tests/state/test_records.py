"""Durable records: atomic status.json, damaged records, the trainer-log readers, and
the states `status` derives from the live system (NODE_LOST, SUPERVISOR_LOST).

Fast: no training and no config validation; real processes, signals and files.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import launcher.state.trainer_log as trainer_log
from launcher.errors import LauncherError
from launcher.run.rootcause import rank_failure, root_cause
from launcher.run.setup import check_earlier_runs
from launcher.state.procs import identity
from launcher.state.record import SCHEMA_VERSION, RunStore, read_record
from launcher.state.trainer_log import TrainerLogFollower, read_trainer_log_tail
from tests.support.common import REPO
from tests.support.fake_rank import eval_line, progress_line
from tests.support.fake_runs import RUN_ID, alive, crafted_run, events, launcher, spawn

# --- atomic status.json -------------------------------------------------------------------------------

WRITER = (
    "import sys\n"
    "from pathlib import Path\n"
    "from launcher.state.record import RunStore\n"
    "store = RunStore.open(Path(sys.argv[1]))\n"
    "print('ready', flush=True)\n"
    "i = 0\n"
    "while True:\n"
    "    i += 1\n"
    "    store.save(job_pid=i, reason='x' * (20000 + i % 7919), processes=[{'pid': i}] * 50)\n"
)


def test_status_json_survives_sigkill_at_random_moments(tmp_path):
    """A loop of status writes killed at random times: the file always parses, readers never see half."""
    rng = random.Random(4)
    RunStore.create(tmp_path, "atomic").save(job_pid=0)
    counters = []
    for _ in range(12):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE)
        assert writer.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + rng.uniform(0.05, 0.4)
        while time.monotonic() < deadline:  # read while it writes
            data = read_record(tmp_path)
            assert data.job_pid == 0 or len(data.reason) == 20000 + data.job_pid % 7919
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        data = read_record(tmp_path)  # raises RecordUnreadable on a partial file
        assert data.run_id == "atomic" and data.schema == SCHEMA_VERSION
        assert data.job_pid == 0 or len(data.reason) == 20000 + data.job_pid % 7919
        counters.append(data.job_pid)
    assert sum(counters) > 0, "the writer never completed a write; the test proved nothing"
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".status.json.")] == ["status.json"]


# --- damaged records ----------------------------------------------------------------------------------

DAMAGED = {
    "empty": b"",
    "truncated": b'{"schema": 1, "run_id": "r", "state": "RUNN',
    "not_an_object": b"[1, 2, 3]",
    "binary": b"\x00\xff\xfe garbage \x80",
    "newer_schema": json.dumps({"schema": SCHEMA_VERSION + 1, "run_id": "r", "state": "RUNNING"}).encode(),
    "unknown_state": json.dumps({"schema": SCHEMA_VERSION, "run_id": "r", "state": "EXPLODED"}).encode(),
}


@pytest.mark.parametrize("kind", [*DAMAGED, "missing"])
def test_damaged_status_is_reported_unreadable_without_a_traceback(tmp_path, kind):
    run_dir = tmp_path / "runs" / "r-20261130-101500"
    (run_dir / "output").mkdir(parents=True)
    if kind != "missing":
        (run_dir / "status.json").write_bytes(DAMAGED[kind])
    path = run_dir / "status.json"
    newest = [] if kind == "missing" else [["status", "--root", run_dir.parent]]  # no status.json: not a run yet
    for args in (["status", run_dir], ["status", run_dir, "--json"], *newest):
        proc = launcher(*args, timeout=60)
        assert proc.returncode != 0, proc.stdout
        assert f"unreadable: {path}" in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr
    stop = launcher("stop", run_dir, timeout=60)
    assert stop.returncode != 0 and f"unreadable: {path}" in stop.stderr and "Traceback" not in stop.stderr
    if kind != "missing":
        listed = launcher("list", "--root", run_dir.parent, timeout=60)
        assert listed.returncode == 0 and "Traceback" not in listed.stdout + listed.stderr
        assert run_dir.name in listed.stdout
    assert (path.read_bytes() == DAMAGED[kind]) if kind != "missing" else not path.exists()  # left as found


# --- trainer log: tail reader and follower ------------------------------------------------------------


def write_lines(path: Path, records: list[dict], mode: str = "a", tail: str = "") -> None:
    with open(path, mode) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_tail_ignores_a_half_written_last_line(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    write_lines(log, [progress_line(s, 10, 1.0) for s in (1, 2, 3)], mode="w", tail='{"current_steps": 4, "tot')
    assert [r["current_steps"] for r in read_trainer_log_tail(log, count=5)] == [1, 2, 3]
    assert read_trainer_log_tail(log)[-1]["current_steps"] == 3
    with open(log, "a") as f:  # a complete object whose newline has not been written yet: still partial
        f.write('al_steps": 10, "loss": 1.0}')
    assert read_trainer_log_tail(log)[-1]["current_steps"] == 3
    with open(log, "a") as f:
        f.write("\n")
    assert read_trainer_log_tail(log)[-1]["current_steps"] == 4
    assert list(trainer_log.iter_trainer_log(log))[-1]["current_steps"] == 4


def test_tail_reads_a_few_kilobytes_of_a_50_mb_log(tmp_path, monkeypatch):
    log = tmp_path / "trainer_log.jsonl"
    line = json.dumps(progress_line(1, 100000, 1.0)) + "\n"
    with open(log, "w") as f:
        f.write(line * (50_000_000 // len(line)))
    write_lines(log, [progress_line(99999, 100000, 1.0), eval_line(99999, 100000)], tail='{"current_steps": 1000')
    assert log.stat().st_size > 50_000_000
    read = []
    real = trainer_log._read_block
    monkeypatch.setattr(trainer_log, "_read_block", lambda fd, off, size: read.append(size) or real(fd, off, size))
    tail = read_trainer_log_tail(log, count=16)
    assert len(tail) == 16 and tail[-1] == eval_line(99999, 100000)
    assert sum(read) <= 16384, read


def test_tail_handles_a_line_longer_than_its_block(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    long = {**progress_line(2, 10, 1.0), "note": "x" * 30000}
    write_lines(log, [progress_line(1, 10, 1.0), long, progress_line(3, 10, 1.0)], mode="w")
    assert [r["current_steps"] for r in read_trainer_log_tail(log, count=3, block=4096)] == [1, 2, 3]


def test_tail_follows_a_deleted_and_recreated_log(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    write_lines(log, [progress_line(s, 100, 1.0) for s in range(1, 51)], mode="w")
    assert read_trainer_log_tail(log)[-1]["current_steps"] == 50
    log.unlink()
    write_lines(log, [progress_line(s, 20, 1.0) for s in (1, 2)], mode="w")
    assert read_trainer_log_tail(log) == [progress_line(2, 20, 1.0)]


def test_follower_waits_for_a_partial_line_and_then_reads_it(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    follower = TrainerLogFollower(log)
    assert follower.poll() is False  # no file yet
    write_lines(log, [progress_line(1, 4, 1.0)], mode="w", tail='{"current_steps": 2, "total_steps": 4, "lo')
    assert follower.poll() is True and follower.summary["step"] == 1
    assert follower.poll() is False
    with open(log, "a") as f:
        f.write('ss": 0.5}\n')
    assert follower.poll() is True
    assert follower.summary["step"] == 2 and follower.summary["loss"] == 0.5 and follower.summary["records"] == 2
    write_lines(log, [eval_line(2, 4), progress_line(4, 4, 1.0)])
    assert follower.poll() is True
    assert follower.summary["best_eval_step"] == 2 and follower.summary["training_done"] is True
    follower.close()


@pytest.mark.parametrize("grow", [False, True], ids=["recreated-smaller", "recreated-larger"])
def test_follower_reads_a_recreated_log_from_its_start(tmp_path, grow):
    """LLaMA-Factory's overwrite_output_dir deletes the log; ext4 hands the new file the old inode number
    at once, so only a held-open file tells the two apart when the new one is already larger."""
    log = tmp_path / "trainer_log.jsonl"
    write_lines(log, [progress_line(s, 100, 1.0) for s in range(1, 6)], mode="w")
    follower = TrainerLogFollower(log)
    assert follower.poll() and follower.summary["records"] == 5
    log.unlink()
    steps = range(1, 12) if grow else range(1, 3)  # 11 lines are longer than the 5 already read
    write_lines(log, [progress_line(s, 20, 1.0) for s in steps], mode="w")
    assert follower.poll() is True
    assert follower.summary["records"] == 5 + len(steps)  # every line of the new file, none lost
    assert follower.summary["step"] == steps[-1] and follower.summary["total_steps"] == 20
    follower.close()


def test_status_shows_the_last_complete_line_of_a_log_being_written(tmp_path):
    run_dir = crafted_run(tmp_path, state="SUCCEEDED", exit_code=0)
    log = run_dir / "output" / "trainer_log.jsonl"
    write_lines(log, [progress_line(s, 10, 1.0) for s in (1, 2, 3)], mode="w", tail='{"current_steps": 4, "tot')
    proc = launcher("status", run_dir, "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["step"] == 3 and info["total_steps"] == 10 and info["percent"] == 30.0


# --- states derived from the live system --------------------------------------------------------------


def test_a_run_live_before_a_reboot_is_node_lost(tmp_path):
    run_dir = crafted_run(tmp_path, boot_id="00000000-0000-4000-8000-000000000000")
    info = json.loads(launcher("status", run_dir, "--json", timeout=60).stdout)
    assert info["state"] == "NODE_LOST" and info["recorded_state"] == "RUNNING"
    text = launcher("status", run_dir, timeout=60).stdout
    assert "NODE_LOST (recorded RUNNING: the host rebooted" in text
    # a new start's supervisor marks it NODE_LOST for good, and says so
    warnings = check_earlier_runs(run_dir.parent)
    assert warnings == [
        f"run {run_dir.name}: the host rebooted (boot id changed) since the run was recorded live; recorded NODE_LOST"
    ]
    status = read_record(run_dir)
    assert status.state == "NODE_LOST" and status.ended and "boot id" in status.reason
    assert events(run_dir)[-1] == {**events(run_dir)[-1], "event": "ended", "state": "NODE_LOST"}
    assert check_earlier_runs(run_dir.parent) == []  # terminal now: nothing more to say


@pytest.fixture
def sleeper(tmp_path):
    """A live process whose command line names ``tmp_path`` (stands in for an orphaned rank)."""
    marker = str(tmp_path / "runs" / RUN_ID)
    proc = spawn(
        [sys.executable, "-c", "import time; time.sleep(600)", marker], marker, start_new_session=True
    )  # like a rank: its own session and process group
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait()


def test_supervisor_lost_lists_survivors_and_stop_cleans_them_up(tmp_path, sleeper):
    run_dir = crafted_run(tmp_path, processes=[identity(sleeper)])
    info = json.loads(launcher("status", run_dir, "--json", timeout=60).stdout)
    assert info["state"] == "SUPERVISOR_LOST" and info["pids"] == [sleeper.pid]
    with pytest.raises(LauncherError, match="still has live training processes"):
        check_earlier_runs(run_dir.parent)
    proc = launcher("stop", run_dir, "--grace", "1", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not alive(sleeper)
    status = read_record(run_dir)
    assert status.state == "SUPERVISOR_LOST" and str(sleeper.pid) in status.reason
    assert events(run_dir)[-1]["event"] == "cleanup"


def test_a_reused_pid_is_never_killed(tmp_path, sleeper):
    """Liveness is pid + start time + command line: a pid that now belongs to another process is left alone."""
    wrong_start = {**identity(sleeper), "create_time": sleeper.create_time() - 1000}
    run_dir = crafted_run(tmp_path, processes=[wrong_start])
    info = json.loads(launcher("status", run_dir, "--json", timeout=60).stdout)
    assert info["state"] == "SUPERVISOR_LOST" and info["pids"] == []
    assert launcher("stop", run_dir, "--grace", "1", timeout=60).returncode == 0
    assert alive(sleeper)


# --- exit codes and root cause from the job's own output ----------------------------------------------

TORCHRUN_FAILURE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
tests.support.fake_rank FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_15:41:19
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 4242) {signame}
  error_file: <N/A>
  traceback : {message}
============================================================
"""


def test_rank_failure_reads_torchruns_summary_of_this_attempt_only(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text(TORCHRUN_FAILURE.format(rank=1, code=3, signame="", message="To enable traceback see: ..."))
    assert rank_failure(log) == {"rank": 1, "pid": 4242, "exit_code": 3, "signal": None}
    start = log.stat().st_size
    assert rank_failure(log, start=start) is None  # an earlier attempt's failure is not this one's
    with open(log, "a") as f:
        f.write(TORCHRUN_FAILURE.format(rank=0, code=-9, signame="(SIGKILL)", message="Signal 9 (SIGKILL) received"))
    assert rank_failure(log, start=start) == {"rank": 0, "pid": 4242, "exit_code": None, "signal": 9}


def test_root_cause_skips_torchruns_own_traceback_and_earlier_attempts(tmp_path):
    from launcher.run.rundir import RunDir

    run = RunDir("r", tmp_path)
    rank_tb = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nValueError: bad shard\n'
    torchrun_tb = (
        'Traceback (most recent call last):\n  File "run.py", line 9, in main\n'
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    run.log.write_text(
        "starting\n" + rank_tb + torchrun_tb + TORCHRUN_FAILURE.format(rank=0, code=1, signame="", message="-")
    )
    assert root_cause(run).endswith("ValueError: bad shard")
    (tmp_path / "errors").mkdir()
    old = {"rank": 0, "time": time.time() - 3600, "traceback": "RuntimeError: attempt 1"}
    (tmp_path / "errors" / "rank0.json").write_text(json.dumps(old))
    assert "attempt 1" in root_cause(run)
    assert root_cause(run, since=time.time() - 60).endswith("ValueError: bad shard")  # attempt 2 ignores it
    assert root_cause(run, since=time.time() - 60, log_start=run.log.stat().st_size) is None


def test_status_shows_the_failing_ranks_own_exit_code(tmp_path):
    failed = {"rank": 1, "pid": 4242, "exit_code": 3, "signal": None}
    run_dir = crafted_run(
        tmp_path,
        state="FAILED",
        exit_code=1,
        failed_rank=failed,
        ended="2026-11-30T10:20:00+00:00",
        reason="exit code 1; first failure: rank 1 (pid 4242) exit code 3",
    )
    text = launcher("status", run_dir, timeout=60).stdout
    assert "code 1 (rank 1: code 3)" in text and "rank 1 (pid 4242) exit code 3" in text


def test_status_imports_neither_the_training_stack_nor_the_validators(tmp_path):
    """What keeps `launcher status` fast (docs/lab/2026-11-30-status-million-lines.md): no torch, pydantic, patches or
    preflight."""
    run_dir = crafted_run(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "launcher", "status", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "launcher.monitor.status" in imported
    heavy = {
        "torch",
        "transformers",
        "llamafactory",
        "pydantic",
        "patches",
        "rich",
        "docker",
        "launcher.config.run_config",
        "launcher.checks.preflight",
        "launcher.results.verify",
        "launcher.results.report",
    }
    assert not heavy & imported, sorted(heavy & imported)
