"""Faults during a run lose nothing: a full disk, a closed pipe or terminal, exit codes, a damaged record.

The disk is a real tmpfs in a private mount namespace (``unshare -m``, root): the whole ``launcher run``
lives in that namespace, and the test fills and frees the disk through ``/proc/PID/root``, the namespace
as the supervisor sees it. When the launcher ends, the namespace copies the run folder out to the test's
own folder (the tmpfs goes with the namespace).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.state.states import EXIT_CODE_TABLE, EXIT_CODES, TERMINAL, RunState, run_exit_code
from tests.support.common import REPO, make_config
from tests.support.fake_runs import (
    PREFLIGHT_SKIP,
    alive,
    fake_config,
    fill_disk,
    kill_all,
    launcher,
    processes_naming,
    wait_for,
)

PROBE = r"""
import json, os, sys
from pathlib import Path
from launcher.state.record import RunStore
from launcher.state.states import RunState
from tests.support.fake_runs import fill_disk

root, free = Path(sys.argv[1]), sys.argv[2] == "free"
run_dir = root / "run"
run_dir.mkdir()
store = RunStore.create(run_dir, "run")
store.transition(RunState.RUNNING, progress={"step": 1})
store.reserve()
fill_disk(root / "filler")
seen = {"good": (run_dir / "status.json").read_text()}
seen["saved"] = store.save(progress={"step": 2})
seen["after_failed_save"] = (run_dir / "status.json").read_text()
store.event("during_outage", step=2)
seen["events_while_full"] = (run_dir / "events.jsonl").read_text()
if free:
    (root / "filler").unlink()
    seen["saved_again"] = store.save(progress={"step": 3})
seen["end_landed"] = store.record_end(RunState.FAILED, reason="test end")
seen["final"] = json.loads((run_dir / "status.json").read_text())
seen["events"] = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
seen["reserve_left"] = (run_dir / ".record-reserve").exists()
print(json.dumps(seen))
"""


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    """Whatever a test leaves running under its folder is killed afterwards."""
    yield
    kill_all(processes_naming(str(tmp_path)))


needs_tmpfs = pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root: unshare -m and mount -t tmpfs")


def tmpfs_command(mount: Path, size_mb: int, argv: list[str], copy_to: Path | None = None) -> list[str]:
    """``argv`` in a private mount namespace with a fresh ``size_mb`` tmpfs on ``mount``; the exit code is
    argv's; ``copy_to`` gets a copy of the tmpfs once argv ended."""
    copy = f' cp -a "{mount}/." "{copy_to}/";' if copy_to else ""
    script = f'mount -t tmpfs -o size={size_mb}m tmpfs "{mount}" || exit 90; "$@"; rc=$?;{copy} exit $rc'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]


# --- the record on a full disk (RunStore alone, fast) ------------------------------------------------------


@needs_tmpfs
@pytest.mark.parametrize("free", [True, False], ids=["space-freed", "disk-stays-full"])
def test_a_record_write_on_a_full_disk_keeps_the_last_good_record_and_the_end_lands(tmp_path, free):
    mount = tmp_path / "disk"
    mount.mkdir()
    cmd = tmpfs_command(mount, 1, [sys.executable, "-c", PROBE, str(mount), "free" if free else "full"])
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["saved"] is False  # refused, not raised
    assert seen["after_failed_save"] == seen["good"]  # the last good record stays, whole
    assert json.loads(seen["after_failed_save"])["progress"] == {"step": 1}
    assert "during_outage" not in seen["events_while_full"]  # held back, not half-written
    assert "cannot write the run record" in proc.stderr and "ENOSPC" in proc.stderr  # reported at once
    if free:
        assert seen["saved_again"] is True
    assert seen["end_landed"] is True  # on a full disk thanks to the reserve given back
    final = seen["final"]
    assert final["state"] == "FAILED" and final["reason"] == "test end"
    outage = final["record_write_failures"]
    assert len(outage) == 1 and outage[0]["until"] is not None and outage[0]["failed_writes"] >= 1
    assert "ENOSPC" in outage[0]["error"]
    kinds = [e["event"] for e in seen["events"]]
    assert kinds[-1] == "ended" and "during_outage" in kinds and "record_write_failed" in kinds
    assert kinds.index("during_outage") < kinds.index("ended")
    assert not seen["reserve_left"]


RANK_PROBE = r"""
import json, sys
from pathlib import Path
from launcher.rank import entry
from patches.core.proof import ProofFile
from tests.support.fake_runs import fill_disk

root = Path(sys.argv[1])
(root / "run").mkdir()
proof = ProofFile(root / "run" / "proof", "demo_patch", 0)
proof.start({"patch": "demo_patch", "status": "checking"})
fill_disk(root / "filler")
seen = {}
proof.update(status="applied", first_call={"device": "cpu"})  # refused: a warning, not an exception
seen["refused"] = proof.refused
seen["on_disk_while_full"] = proof.read()
try:
    raise OSError(28, "No space left on device", str(root / "run" / "output" / "checkpoint-7"))
except OSError as exc:
    entry.write_error_file(root / "run", exc)  # on the full disk: must not mask the error
seen["error_file_written"] = (root / "run" / "errors" / "rank0.json").exists()
(root / "filler").unlink()
proof.update(first_training_step={"layers": 4})  # the disk is back: the whole record lands
seen["on_disk_after"] = proof.read()
print(json.dumps(seen))
"""


@needs_tmpfs
def test_a_rank_side_record_on_a_full_disk_is_a_warning_and_lands_whole_once_space_returns(tmp_path):
    """A rank must never die of the launcher's own writes (proof records, the error record): on a real full tmpfs
    they warn with the errno, the path and the free bytes, and the next write after space returns holds all."""
    mount = tmp_path / "disk"
    mount.mkdir()
    cmd = tmpfs_command(mount, 1, [sys.executable, "-c", RANK_PROBE, str(mount)])
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["refused"]["errno"] == "ENOSPC" and seen["refused"]["free_bytes"] == 0
    assert seen["refused"]["path"].endswith("demo_patch.json")
    assert seen["on_disk_while_full"]["status"] == "checking"  # the last good record, whole
    assert not seen["error_file_written"]
    assert "could not write the proof of patch demo_patch" in proc.stderr and "training goes on" in proc.stderr
    assert "could not write this rank's error record" in proc.stderr
    after = seen["on_disk_after"]
    assert after["status"] == "applied" and after["first_call"] == {"device": "cpu"}
    assert after["first_training_step"] == {"layers": 4}


LOG_PROBE = r"""
import sys
from launcher.files import DiskTolerantStream
if sys.argv[1] == "tolerant":
    sys.stdout, sys.stderr = DiskTolerantStream(sys.stdout), DiskTolerantStream(sys.stderr)
for step in range(50):  # what a progress bar and the Trainer's prints send to the run's log at every step
    print(f"step {step}: " + "x" * 200, flush=True)
    print(f"{step}/50", file=sys.stderr, flush=True)
sys.stdout.flush()
sys.__stdout__ = None  # nothing is left to write at exit: the exit code is the loop's
"""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, the device that refuses every write")
def test_a_rank_whose_log_disk_refuses_writes_keeps_going_and_other_errors_still_raise():
    """The job's stdout and stderr go to the run's log on the run's disk. /dev/full refuses every write with
    ENOSPC, as a full disk does: a rank entry's streams (``entry.main`` wraps them) drop the text and go on, where
    a plain stream ends the process. A broken pipe is no disk's refusal: it still raises."""
    from launcher.files import DiskTolerantStream

    def probe(mode: str) -> subprocess.CompletedProcess:
        with open("/dev/full", "w") as full:
            return subprocess.run(
                [sys.executable, "-c", LOG_PROBE, mode],
                stdout=full,
                stderr=full,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                timeout=120,
            )

    assert probe("plain").returncode != 0  # the premise: a refused write ends a plain process
    assert probe("tolerant").returncode == 0
    read, write = os.pipe()
    os.close(read)
    raw = os.fdopen(write, "w", buffering=1)
    with pytest.raises(BrokenPipeError):
        DiskTolerantStream(raw).write("x\n")
    with contextlib.suppress(OSError):
        raw.close()


def test_a_rank_killed_by_a_disk_error_has_the_disk_named_first_in_its_root_cause(tmp_path):
    from launcher.rank import entry
    from launcher.run.rootcause import disk_state, root_cause
    from launcher.run.rundir import RunDir

    try:
        raise OSError(30, "Read-only file system", str(tmp_path / "output" / "checkpoint-7" / "adapter.bin"))
    except OSError as exc:
        entry.write_error_file(tmp_path, exc)
    cause = root_cause(RunDir("run", tmp_path))
    assert cause.startswith("rank 0: the disk refused a write: EROFS (Read-only file system) writing ")
    assert "checkpoint-7" in cause.splitlines()[0] and "bytes free" in cause.splitlines()[0]
    assert disk_state(tmp_path) is None  # this test's own disk is fine
    assert disk_state(tmp_path, least_free=1 << 62).startswith("the run folder's disk is full (")


# --- a failing disk under the filesystem: EIO, and the kernel's emergency read-only remount ----------------------

DEAD_DISK_PROBE = r"""
import json, os, sys
from pathlib import Path
from launcher.state.record import RunStore
from launcher.state.states import RunState
from tests.support.fake_runs import fill_disk

mnt, backing = Path(sys.argv[1]), Path(sys.argv[2])
run_dir = mnt / "run"
run_dir.mkdir()
store = RunStore.create(run_dir, "run")
store.transition(RunState.RUNNING, progress={"step": 1})
good = (run_dir / "status.json").read_text()
fill_disk(backing / "filler")  # the block device's own storage
seen = {"saved": store.save(progress={"step": 2}), "error": (store.failing or {}).get("error")}
store.event("during_outage", step=2)
seen["end_landed"] = store.record_end(RunState.FAILED, reason="test end")
seen["kept"] = (run_dir / "status.json").read_text() == good
seen["events"] = (run_dir / "events.jsonl").read_text()
seen["mount"] = next(line for line in open("/proc/self/mounts") if str(mnt) in line)
print(json.dumps(seen))
"""


def _dead_disk_command(tmp_path: Path) -> list[str]:
    """The probe on an ext4 on a loop device whose backing file lies on a 8 MiB tmpfs, in a private mount
    namespace: the test fills the tmpfs, and the block device's next write fails (a real I/O error under
    the filesystem, as a dying disk gives), after which ext4 remounts itself read-only (errors=remount-ro)."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    script = (
        f'mount -t tmpfs -o size=8m tmpfs "{backing}" || exit 90; truncate -s 64m "{backing}/img" && '
        f'mkfs.ext4 -q -F -E lazy_itable_init=1,lazy_journal_init=1 "{backing}/img" || exit 91; '
        f'mount -o loop,errors=remount-ro "{backing}/img" "{mnt}" || exit 92; "$@"'
    )
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        sys.executable,
        "-c",
        DEAD_DISK_PROBE,
        str(mnt),
        str(backing),
    ]


def _can_loop_mount() -> bool:
    if not _can_mount_tmpfs() or shutil.which("mkfs.ext4") is None:
        return False
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            "mount -t tmpfs tmpfs /mnt && truncate -s 8m /mnt/i && "
            "mkfs.ext4 -q /mnt/i && mkdir /mnt/m && mount -o loop /mnt/i /mnt/m",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_loop_mount(), reason="needs root, loop devices and mkfs.ext4")
def test_a_failing_block_device_never_raises_from_the_record_writer_and_keeps_the_last_good_record(tmp_path):
    """Which error the kernel reports first varies from run to run: EIO (a failed journal write, which also
    aborts the journal), ENOSPC (a failed data write) or EROFS (the filesystem already remounted itself
    read-only). All take the same path: refused, kept in memory, reported; nothing lands on a dead disk."""
    proc = subprocess.run(
        _dead_disk_command(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["saved"] is False and seen["end_landed"] is False  # refused, not raised
    assert seen["kept"]  # the last good status.json, whole
    assert "during_outage" not in seen["events"] and "ended" not in seen["events"]  # held, never half-written
    errno_name = seen["error"].split(":")[0]
    assert errno_name in ("EIO", "ENOSPC", "EROFS"), seen["error"]
    assert f"cannot write the run record in {tmp_path / 'mnt' / 'run'} ({errno_name}: " in proc.stderr
    assert "Traceback" not in proc.stderr
    print(f"\nfailing block device: the record writer saw {seen['error']}; mount now: {seen['mount'].strip()}")


def test_an_eio_keeps_the_last_good_record_and_is_the_error_reported(tmp_path, monkeypatch):
    """EIO injected by hand (faked: no device here fails on demand; the test above gets a real EIO only on
    some runs): ``os.fsync`` of the run's files fails with EIO, and removing the temporary file fails with
    EROFS, as when the kernel remounts a disk read-only on that I/O error. The record writer must keep the
    last good record and report the EIO, the first error, not the EROFS of its clean-up."""
    import errno

    from launcher.state.record import RunStore
    from launcher.state.states import RunState

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store = RunStore.create(run_dir, "run")
    store.transition(RunState.RUNNING, progress={"step": 1})
    good = (run_dir / "status.json").read_text()
    real_fsync, real_unlink = os.fsync, Path.unlink
    broken = {"on": True}

    def fsync(fd: int) -> None:
        if broken["on"] and os.readlink(f"/proc/self/fd/{fd}").startswith(str(run_dir)):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    def unlink(path: Path, missing_ok: bool = False) -> None:
        if broken["on"] and str(path).startswith(str(run_dir)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "unlink", unlink)
    assert store.save(progress={"step": 2}) is False
    assert (run_dir / "status.json").read_text() == good
    assert store.failing["error"].startswith("EIO: ")
    store.event("during_outage", step=2)
    broken["on"] = False
    for leftover in run_dir.glob(".status.json.*.tmp"):  # what the failed clean-up left
        leftover.unlink()
    assert store.record_end(RunState.FAILED, reason="test end") is True
    final = json.loads((run_dir / "status.json").read_text())
    (outage,) = final["record_write_failures"]
    assert outage["error"].startswith("EIO: ") and outage["until"] is not None
    kinds = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert kinds[-3:] == ["during_outage", "record_write_failed", "ended"]


# --- exit codes -----------------------------------------------------------------------------------------------


def test_every_terminal_state_has_an_exit_code_and_only_success_is_zero():
    assert set(EXIT_CODES) == set(TERMINAL)
    for state in TERMINAL:
        for job in ({"exit_code": 1}, {"exit_code": None, "signal": 9}, {"exit_code": 0}):
            code = run_exit_code(state, **job, stop_signal=15 if state.value in ("CANCELLED", "TERMINATED") else None)
            assert (code == 0) == (state is RunState.SUCCEEDED), (state, job, code)
    assert run_exit_code(RunState.CANCELLED, exit_code=1, stop_signal=15) == 143
    assert run_exit_code(RunState.TERMINATED, exit_code=0, stop_signal=1) == 129
    assert run_exit_code(RunState.FAILED, exit_code=None, signal=9) == 137
    assert run_exit_code(RunState.FAILED, exit_code=3) == 3
    with pytest.raises(ValueError):
        run_exit_code(RunState.RUNNING)


def test_the_exit_code_table_is_in_run_help_and_readme():
    shown = launcher("run", "--help", timeout=60)
    assert shown.returncode == 0
    readme = (REPO / "README.md").read_text()
    for line in EXIT_CODE_TABLE.splitlines()[1:]:
        assert line.strip() in shown.stdout, line
        assert line.strip().split(None, 1)[-1] in readme, line


# --- closed pipes -----------------------------------------------------------------------------------------------


def test_a_closed_pipe_ends_list_and_status_without_a_traceback(tmp_path):
    from tests.support.fake_runs import write_record

    root = tmp_path / "runs"
    for i in range(200):
        write_record(root / f"r{i:03d}-20261130-101500", run_id=f"r{i:03d}-20261130-101500", state="FAILED")
    for args in (["list", "--root", root], ["status", root / "r000-20261130-101500"]):
        read, write = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", *map(str, args)],
            cwd=REPO,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(write)
        os.close(read)  # the reader is gone before the launcher writes a line (as `| head` after its lines)
        _, err = proc.communicate(timeout=120)
        assert "Traceback" not in err and "BrokenPipe" not in err, err
        assert proc.returncode == 141, (args, proc.returncode, err)


# --- verify keeps an earlier PASS ------------------------------------------------------------------------------------


def test_verify_does_not_replace_an_earlier_pass_with_a_fail_from_damage(tmp_path):
    from launcher.results.verify import CheckResult, VerifyReport, _write
    from launcher.state.runs import RECHECK_FILE, VERIFY_FILE

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ok = VerifyReport(run_dir, "run", [CheckResult("adapter", "final adapter", "PASS", "64 tensors")])
    _write(ok, run_dir)
    first = (run_dir / VERIFY_FILE).read_text()
    damaged = VerifyReport(run_dir, "run", [CheckResult("adapter", "final adapter", "FAIL", "unreadable")])
    _write(damaged, run_dir)
    assert (run_dir / VERIFY_FILE).read_text() == first  # the PASS stays
    assert json.loads((run_dir / RECHECK_FILE).read_text())["passed"] is False  # the new FAIL is reported
    assert damaged.written == run_dir / RECHECK_FILE and "keeps the PASS" in damaged.kept
    fixed = VerifyReport(run_dir, "run", [CheckResult("adapter", "final adapter", "PASS", "64 tensors")])
    _write(fixed, run_dir)  # a PASS is always written
    assert fixed.written == run_dir / VERIFY_FILE and fixed.kept is None


# --- a full disk under a real run (fake ranks under the real torchrun) ---------------------------------------------


def _tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class DiskRun:
    """``launcher run`` with its runs folder on a small private tmpfs: fake ranks acting as ``spec`` says, or
    (``real``) the tiny model through the real entry, held between steps as ``spec`` says
    (tests/support/fault_entry.py)."""

    def __init__(self, tmp_path: Path, demo_assets, spec: dict, real: bool = False, **settings):
        self.mount, self.copy = tmp_path / "disk", tmp_path / "after"
        self.mount.mkdir()
        self.copy.mkdir()
        root = str(self.mount / "runs")
        if real:
            cfg = make_config(
                tmp_path, demo_assets, launcher={"entry": "tests.support.fault_entry", "output_root": root, **settings}
            )
            env = {**os.environ, "FAULT_SPEC": json.dumps(spec), "PYTHONPATH": str(REPO)}
        else:
            cfg, env = fake_config(tmp_path, demo_assets, {"quiet": True, **spec}, output_root=root, **settings)
        # preflight's output row wants 0.5 GiB free for a real run; this disk is small on purpose
        self.env = {**env, "LAUNCHER_PREFLIGHT_SKIP": f"{PREFLIGHT_SKIP},output"}
        self.out = tmp_path / "run.out"
        argv = [sys.executable, "-m", "launcher", "run", str(cfg), "--quiet"]
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                tmpfs_command(self.mount, 16, argv, self.copy),
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def live_root(self) -> Path:
        """The runs folder as the supervisor's mount namespace sees it."""
        return Path(f"/proc/{self.proc.pid}/root") / str(self.mount).lstrip("/") / "runs"

    def run_dir(self) -> Path:
        return wait_for(
            "the run folder on the tmpfs",
            lambda: next((p for p in self.live_root.iterdir() if (p / "status.json").exists()), None),
            timeout=240,
        )

    def status(self, run_dir: Path) -> dict:
        return json.loads((run_dir / "status.json").read_text())

    def at_step_3(self) -> tuple[Path, int, dict[str, str]]:
        """Once the record shows step 3: the run folder, rank 0's pid and the hashes of checkpoint-2."""
        run_dir = self.run_dir()
        wait_for("step 3 in the record", lambda: (self.status(run_dir).get("progress") or {}).get("step") == 3)
        rank = json.loads((run_dir / "fake_ranks" / "rank0.json").read_text())["pid"]
        return run_dir, rank, _tree_hashes(run_dir / "output" / "checkpoint-2")

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def _mount(self, *options: str) -> None:
        """``mount OPTIONS`` on the tmpfs, inside the run's mount namespace."""
        argv = ["nsenter", "-t", str(self.proc.pid), "-m", "mount", *options, str(self.mount)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    def refuse_writes(self, how: str) -> None:
        """The disk refuses writes: full to the last byte, or read-only.

        Read-only as a remount does it to every path under the mount: the tmpfs itself cannot be remounted
        read-only while the job's log is open for writing (EBUSY; the kernel's own errors=remount-ro forces
        it, a tmpfs has no such errors), so a bind mount of it over itself is remounted read-only, and every
        file opened from then on (each record write opens its file) gets EROFS."""
        if how == "full":
            fill_disk(self.live_root.parent / "filler")
        else:
            self._mount("--bind", str(self.mount))
            self._mount("-o", "remount,bind,ro")

    def accept_writes(self, how: str) -> None:
        if how == "full":
            (self.live_root.parent / "filler").unlink()
        else:
            self._mount("-o", "remount,bind,rw")


REFUSALS = pytest.mark.parametrize(
    ("how", "errno_name"), [("full", "ENOSPC"), ("read-only", "EROFS")], ids=["disk-full", "read-only"]
)


@needs_tmpfs
@pytest.mark.slow
@REFUSALS
def test_writes_refused_mid_run_the_job_keeps_training_and_succeeds_once_writes_land(
    tmp_path, demo_assets, how, errno_name
):
    """The tiny model trains on a small tmpfs through the real entry, LLaMA-Factory and the Trainer. Once step 3
    is done (checkpoint-3 and its evaluation written), the disk refuses every write: the job trains steps 4
    and 5 all the same (its launcher records warn, LLaMA-Factory's trainer-log lines are lost), the supervisor
    reports the record write it could not make and lives on. Then the disk takes writes again and the run
    reaches its 6 planned steps, checkpoint-6, and SUCCEEDED (the acceptance checklist passed)."""
    run = DiskRun(tmp_path, demo_assets, {"hold_after": [3, 5], "hold_dir": str(tmp_path)}, real=True)
    try:
        rank = int(wait_for("step 3 done", lambda: (tmp_path / "held-3").read_text(), timeout=600))
        run_dir = run.run_dir()
        kept = _tree_hashes(run_dir / "output" / "checkpoint-3")
        run.refuse_writes(how)
        wait_for(
            "the supervisor to report the refused write",
            lambda: "cannot write the run record" in run.output(),
            timeout=60,
        )
        assert f"({errno_name}: " in run.output()
        (tmp_path / "go-3").touch()
        wait_for("steps 4 and 5 trained while the disk refuses writes", (tmp_path / "held-5").exists, timeout=600)
        during = run.status(run_dir)  # the last good record, whole
        assert during["state"] == "RUNNING" and during["record_write_failures"] == []
        assert run.proc.poll() is None and alive_pid(rank), "the job or the supervisor died of the refused writes"
        run.accept_writes(how)
        wait_for(
            "the outage in the record once writes land again",
            lambda: [f for f in run.status(run_dir)["record_write_failures"] if f["until"]],
            timeout=60,
        )
        (tmp_path / "go-5").touch()
        rc = run.proc.wait(timeout=600)
    finally:
        kill_all(processes_naming(str(tmp_path)))
    final_dir = the_copy(run.copy)
    status = json.loads((final_dir / "status.json").read_text())
    assert rc == 0, run.output()[-3000:]
    assert status["state"] == "SUCCEEDED" and status["acceptance"]["passed"] is True, status["reason"]
    assert status["progress"]["step"] == 6 and (final_dir / "output" / "checkpoint-6").is_dir()
    outage = status["record_write_failures"]
    assert len(outage) == 1 and errno_name in outage[0]["error"] and outage[0]["failed_writes"] >= 1
    kinds = [json.loads(line)["event"] for line in (final_dir / "events.jsonl").read_text().splitlines()]
    assert kinds[-1] == "ended" and "record_write_failed" in kinds
    assert "the run record in" in run.output() and "is written again" in run.output()
    assert _tree_hashes(final_dir / "output" / "checkpoint-3") == kept  # the checkpoint written before is intact
    assert not (final_dir / ".record-reserve").exists()


@needs_tmpfs
@pytest.mark.slow
def test_disk_full_for_good_the_supervisor_stops_the_job_and_leaves_an_end_record(tmp_path, demo_assets):
    spec = {"lines": 8, "interval": 0.2, "checkpoints": 2, "stall_after": 3, "resume_file": str(tmp_path / "never")}
    run = DiskRun(tmp_path, demo_assets, spec, record_write_stop_s=2)
    try:
        run_dir, rank, kept = run.at_step_3()
        fill_disk(run.live_root.parent / "filler")
        rc = run.proc.wait(timeout=240)  # never freed: the supervisor must end the run by itself
    finally:
        kill_all(processes_naming(str(tmp_path)))
    final_dir = the_copy(run.copy)
    status = json.loads((final_dir / "status.json").read_text())
    assert rc not in (0, None), run.output()
    assert status["state"] == "FAILED", status
    assert "could not be written" in status["reason"] and "ENOSPC" in status["reason"]
    assert status["processes"] == [] and not alive_pid(rank)
    events = [json.loads(line) for line in (final_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "ended" and events[-1]["state"] == "FAILED"
    assert "stopping" in [e["event"] for e in events]
    assert _tree_hashes(final_dir / "output" / "checkpoint-2") == kept
    assert "the run record in" in run.output() and "Traceback" not in run.output()


def holds_flock(pid: int, path: Path) -> bool:
    """Whether process ``pid`` holds a flock on ``path`` now (/proc/locks: works on a read-only mount, where
    the lock file cannot be opened for writing to test it)."""
    st = os.stat(path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[4] == str(pid) and fields[5] == inode:
            return True
    return False


@needs_tmpfs
@pytest.mark.slow
def test_read_only_for_good_the_supervisor_stops_the_job_and_holds_the_lock_until_the_end_lands(tmp_path, demo_assets):
    """A disk remounted read-only takes no byte: not even the reserve can make room for the end record. The
    supervisor stops the job after record_write_stop_s, keeps the end in memory and the lock held, and
    leaves the last good record (RUNNING, its last step) whole; once the disk is writable again the end lands,
    and only then is the lock released."""
    spec = {"lines": 8, "interval": 0.2, "checkpoints": 2, "stall_after": 3, "resume_file": str(tmp_path / "never")}
    run = DiskRun(tmp_path, demo_assets, spec, record_write_stop_s=2)
    try:
        run_dir, rank, kept = run.at_step_3()
        last_good = (run_dir / "status.json").read_text()
        supervisor = json.loads(last_good)["supervisor"]["pid"]
        run.refuse_writes("read-only")
        wait_for("the job to be stopped", lambda: not alive_pid(rank), timeout=120)
        wait_for(
            "the supervisor to say the end is not on disk yet",
            lambda: "is not on disk yet" in run.output(),
            timeout=120,
        )
        assert run.proc.poll() is None and holds_flock(supervisor, run.live_root / "launcher.lock")
        assert (run_dir / "status.json").read_text() == last_good  # the most precise record this disk allows
        assert "(EROFS: " in run.output() and "Traceback" not in run.output()
        run.accept_writes("read-only")  # the disk is fixed: the end lands, then the lock is released
        rc = run.proc.wait(timeout=240)
    finally:
        kill_all(processes_naming(str(tmp_path)))
    final_dir = the_copy(run.copy)
    status = json.loads((final_dir / "status.json").read_text())
    assert rc not in (0, None), run.output()
    assert status["state"] == "FAILED" and "could not be written" in status["reason"] and "EROFS" in status["reason"]
    assert status["processes"] == [] and status["progress"]["step"] == 3
    (outage,) = status["record_write_failures"]
    assert "EROFS" in outage["error"] and outage["until"] is not None
    events = [json.loads(line) for line in (final_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "ended" and events[-1]["state"] == "FAILED"
    kinds = [e["event"] for e in events]
    assert kinds.index("stopping") < kinds.index("record_write_failed") < kinds.index("ended")
    assert _tree_hashes(final_dir / "output" / "checkpoint-2") == kept


def alive_pid(pid: int) -> bool:
    import psutil

    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def the_copy(folder: Path) -> Path:
    runs = [p for p in (folder / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_list_shows_what_status_shows_for_a_lost_supervisor_and_a_rebooted_host(tmp_path):
    from tests.support.fake_runs import crafted_run

    lost = crafted_run(tmp_path, name="lost-20261130-101500")
    rebooted = crafted_run(tmp_path, name="boot-20261130-101500", boot_id="00000000-0000-4000-8000-000000000000")
    listed = launcher("list", "--root", tmp_path / "runs", timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
    for run_dir in (lost, rebooted):
        shown = json.loads(launcher("status", run_dir, "--json", timeout=60).stdout)["state"]
        assert rows[run_dir.name] == shown != "RUNNING", (run_dir.name, rows, shown)
    assert rows[lost.name] == "SUPERVISOR_LOST" and rows[rebooted.name] == "NODE_LOST"


@pytest.mark.slow
def test_a_foreground_run_whose_terminal_closes_ends_terminated_and_exits_129(tmp_path, demo_assets):
    from tests.support.fake_runs import read_status, wait_for_growth, wait_for_run_dir
    from tests.support.terminal import hang_up, in_pty

    cfg, env = fake_config(tmp_path, demo_assets, {"lines": 100000, "interval": 0.2, "total_steps": 100000})
    err = tmp_path / "stderr.txt"
    # the launcher leads the terminal's session, as a login shell's foreground job gets the hangup; its
    # stdout is the terminal, its stderr a file the test can read for a traceback afterwards
    pid, fd = in_pty(["sh", "-c", f'exec "{sys.executable}" -m launcher run "{cfg}" 2>"{err}"'], env)
    run_dir = wait_for_run_dir(tmp_path / "runs")
    wait_for_growth(run_dir / "output" / "trainer_log.jsonl", lines=2)
    ended = hang_up(pid, fd, timeout=120)  # the terminal closes (an SSH session ends)
    status = read_status(run_dir)
    assert os.WIFEXITED(ended) and os.WEXITSTATUS(ended) == 129, (ended, err.read_text()[-3000:])
    assert status["state"] == "TERMINATED" and status["stop_signal"] == 1 and status["run_exit_code"] == 129
    assert "terminal closed" in status["stopped_by"]
    assert "Traceback" not in err.read_text(), err.read_text()[-3000:]


# --- who sent the stop signal (siginfo: si_pid, si_uid) ---------------------------------------------------------

SENDER = "import os, sys, time; os.kill(int(sys.argv[1]), 15); time.sleep(600)"


def _blocked_mask(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigBlk:"))
    return int(line.split()[1], 16)


def test_stop_signals_are_taken_with_their_sender_and_children_start_unblocked():
    from launcher.run.signals import StopSignals

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    int_handler = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under a background shell
    with StopSignals() as stops:
        with stops.unblocked():  # how the supervisor spawns its job
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert _blocked_mask(child.pid) & (1 << (signal.SIGTERM - 1)) == 0  # the job can die of SIGTERM
        finally:
            child.kill()
            child.wait()
        sender = subprocess.Popen([sys.executable, "-c", SENDER, str(os.getpid()), "stop-sender"])
        try:
            got = stops.wait(60)
        finally:
            sender.kill()
            sender.wait()
        assert got is not None and got.pid == sender.pid and got.uid == os.getuid() and got.signum == signal.SIGTERM
        assert got.describe().startswith(f"SIGTERM from pid {sender.pid} (") and "stop-sender" in got.describe()
        os.kill(os.getpid(), signal.SIGINT)  # pending when the block ends: taken, not a KeyboardInterrupt
    assert stops.first == got  # the first signal is the one kept
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    assert signal.getsignal(signal.SIGINT) is int_handler


# run in a process of its own, as a supervising verb is: the hold comes first, while it has one thread
INTERRUPTED = r"""
import json, os, signal, subprocess, sys, threading, time
from launcher.run.signals import StopRequested, StopSignals, end_hold_guard, hold_stop_signals

hold_stop_signals()
end_hold_guard()  # as supervise does before it makes the run folder

def blocked(tid):
    line = next(x for x in open(f"/proc/self/task/{tid}/status") if x.startswith("SigBlk:"))
    return int(line.split()[1], 16)

out = {}
with StopSignals() as stops:
    try:
        with stops.interrupting():
            made = threading.Thread(target=time.sleep, args=(60,), daemon=True)
            made.start()
            out["made_thread_mask"] = blocked(made.native_id)
            sender = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), "stop-sender"])
            out["sender"] = sender.pid
            subprocess.run(["sleep", "600"])  # blocking work, as preflight's kernel check in its child process
        out["raised"] = False
    except StopRequested:
        out["raised"] = True
    finally:
        sender.kill()
    out["first"] = stops.first.to_dict()
    with stops.unblocked():
        child = subprocess.Popen(["sleep", "60"])
    line = next(x for x in open(f"/proc/{child.pid}/status") if x.startswith("SigBlk:"))
    out["job_mask"] = int(line.split()[1], 16)
    child.kill()
print(json.dumps(out))
"""
STOPS = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGHUP - 1))


def test_a_stop_during_blocking_work_ends_it_names_its_sender_and_every_thread_blocks_the_signals():
    """``interrupting`` (preflight's guard): a SIGTERM ends a blocking wait at once and is taken with its sender;
    a thread the work makes blocks the stop signals (it could otherwise take one and hide who sent it); the
    job is spawned with none blocked."""
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, SENDER], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["raised"] and out["first"]["pid"] == out["sender"] and out["first"]["signal"] == signal.SIGTERM, out
    assert out["made_thread_mask"] & STOPS == STOPS, out
    assert out["job_mask"] & STOPS == 0, out


# `launcher run` whose config takes long to load (a stand-in for a slow LLaMA-Factory import or model folder)
SLOW_LOAD = r"""
import sys, time
import launcher.config.run_config as config
from launcher.cli import main

def slow_load(*args, **kwargs):
    print("loading", flush=True)
    time.sleep(600)

config.load_run_config = slow_load
sys.exit(main(["run", sys.argv[1]]))
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_before_the_run_is_made_ends_the_command_at_once_and_makes_nothing(tmp_path, stop):
    """A supervising verb holds the stop signals from its first line; until the run folder is made a watcher
    takes them, so a stop (docker stop, Ctrl-C) during the config's load still ends the command at once, with
    its exit code and one line, and no run. The load is a stand-in that sleeps (the real one takes seconds)."""
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_LOAD, str(tmp_path / "cfg.yaml")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "loading\n"
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + stop, (proc.returncode, err)
    assert err.strip() == f"stopped by {stop.name} before a run was made; nothing was started", err
    assert not runs.exists()


DROPPED = r"""
import os, signal, time
from launcher.run.signals import STOP_SIGNALS, drop_hold, hold_stop_signals

# as a terminal starts it: a test run in the background inherits SIGINT ignored, and Python then installs no handler
signal.signal(signal.SIGINT, signal.default_int_handler)
hold_stop_signals()
drop_hold()  # as `launcher resume --foreground` on the host of a container run does
print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(STOP_SIGNALS)), flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


def test_a_process_that_will_not_supervise_after_all_drops_the_hold():
    """``launcher resume --foreground`` on the host resumes a container run in a new container and only waits
    for it: Ctrl-C is a KeyboardInterrupt there again (exit 130, the container goes on), not a held signal."""
    done = subprocess.run([sys.executable, "-c", DROPPED], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[:2] == ["[]", "KeyboardInterrupt"], (done.stdout, done.stderr[-2000:])


@pytest.mark.slow
def test_every_thread_of_a_foreground_supervisor_blocks_the_stop_signals_and_its_job_none(tmp_path, demo_assets):
    """The libraries a supervisor loads make threads (numpy's, pyarrow's); one that did not block SIGTERM could
    take a `docker stop` and leave its sender unnamed. The main thread blocks them too, but for the moments it
    waits in sigtimedwait (which unblocks them while it waits)."""
    from tests.support.fake_runs import launcher_bg, rank_processes, wait_for_run_dir

    cfg, env = fake_config(tmp_path, demo_assets, {"lines": 100000, "interval": 0.2, "total_steps": 100000})
    supervisor = launcher_bg("run", cfg, "--quiet", env=env, log=tmp_path / "run.out")
    try:
        run_dir = wait_for_run_dir(tmp_path / "runs")
        (job,) = rank_processes(run_dir, 1)  # the job runs: preflight and its threads are done
        threads = sorted(int(t.name) for t in Path(f"/proc/{supervisor.pid}/task").iterdir())
        masks = {tid: _blocked_mask(tid) for tid in threads if tid != supervisor.pid}
        assert len(masks) >= 1 and all(m & STOPS == STOPS for m in masks.values()), masks
        assert _blocked_mask(job.pid) & STOPS == 0
    finally:
        supervisor.terminate()
        supervisor.wait(timeout=120)


@pytest.mark.slow
def test_the_record_names_the_process_that_sent_sigterm_to_a_foreground_run(tmp_path, demo_assets):
    from tests.support.fake_runs import launcher_bg, rank_processes, read_status, spawn, wait_for_run_dir

    cfg, env = fake_config(tmp_path, demo_assets, {"lines": 100000, "interval": 0.2, "total_steps": 100000})
    supervisor = launcher_bg("run", cfg, "--quiet", env=env, log=tmp_path / "run.out")
    run_dir = wait_for_run_dir(tmp_path / "runs")
    rank_processes(run_dir, 1)  # the job runs: the supervisor is in its watch loop
    # a known process sends the signal and stays alive, as `kill` in a shell script that goes on
    sender = spawn([sys.executable, "-c", SENDER, str(supervisor.pid), "stop-sender"], "stop-sender")
    try:
        rc = supervisor.wait(timeout=120)
    finally:
        sender.kill()
        sender.wait()
    status = read_status(run_dir)
    out = (tmp_path / "run.out").read_text()
    assert rc == 143 and status["state"] == "TERMINATED", out[-3000:]
    assert "ended TERMINATED (job " in out and "; `launcher run` exits 143)" in out, out[-3000:]  # the code it exits
    assert status["stopped_by"].startswith(f"SIGTERM from pid {sender.pid} ("), status["stopped_by"]
    assert "stop-sender" in status["stopped_by"] and f"uid {os.getuid()})" in status["stopped_by"]
    assert status["stop_sender"]["pid"] == sender.pid and status["stop_sender"]["uid"] == os.getuid()
    assert status["stop_sender"]["signal"] == 15 and status["stop_sender"]["si_code"] == 0  # SI_USER: kill()
    assert f"pid {sender.pid}" in status["reason"]
    shown = launcher("status", run_dir, env=env, timeout=60).stdout
    assert f"SIGTERM from pid {sender.pid}" in shown


def _can_unshare_pid() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare_pid(), reason="needs root: unshare -p -f --mount-proc (a pid namespace)")
def test_sigterm_from_outside_the_pid_namespace_is_recorded_as_the_container_engine(tmp_path, demo_assets):
    """The launcher as a container's main process (pid 1 of its own pid namespace, as under docker); the
    test, outside that namespace, sends SIGTERM as the engine does for `docker stop`: the kernel reports
    si_pid 0, since the sender has no pid in the namespace."""
    import psutil

    from tests.support.fake_runs import read_status, wait_for_growth, wait_for_run_dir

    cfg, env = fake_config(tmp_path, demo_assets, {"lines": 100000, "interval": 0.2, "total_steps": 100000})
    argv = [
        "unshare",
        "-p",
        "-f",
        "--mount-proc",
        "--kill-child",
        sys.executable,
        "-m",
        "launcher",
        "run",
        str(cfg),
        "--quiet",
    ]
    with open(tmp_path / "run.out", "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        run_dir = wait_for_run_dir(tmp_path / "runs")
        wait_for_growth(run_dir / "output" / "trainer_log.jsonl", lines=1)  # the job runs
        assert read_status(run_dir)["supervisor"]["pid"] == 1  # pid 1 of its namespace, as in a container
        (main,) = psutil.Process(proc.pid).children()  # unshare --fork: its one child is the namespace's pid 1
        main.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        kill_all(processes_naming(str(tmp_path)))
    status = read_status(run_dir)
    assert rc == 143 and status["state"] == "TERMINATED", (tmp_path / "run.out").read_text()[-3000:]
    assert status["stopped_by"].startswith("SIGTERM from outside this pid namespace (si_pid 0: the container engine")
    assert status["stop_sender"]["pid"] == 0 and status["stop_sender"]["si_code"] == 0


def test_a_sigtimedwait_record_that_names_no_stop_signal_is_no_stop(monkeypatch, capsys):
    """Seen once in the Slurm test cluster under load: the watcher's ``sigtimedwait`` gave ``si_signo`` 1111501904
    and the node's launcher stopped itself, nobody having stopped it. Stood in here by the record ``sigtimedwait``
    returns (the kernel's own cannot be made to do it); a real stop signal is still taken, with its sender."""
    import types

    from launcher.run import signals

    records = iter(
        [
            types.SimpleNamespace(si_signo=1111501904, si_pid=0, si_uid=0, si_code=0),
            types.SimpleNamespace(si_signo=int(signal.SIGTERM), si_pid=1, si_uid=0, si_code=0),
        ]
    )
    monkeypatch.setattr(signals.signal, "sigtimedwait", lambda _set, _timeout: next(records))
    assert signals.take(signals.STOP_SIGNALS, 0) is None
    assert "si_signo 1111501904, not a stop signal" in capsys.readouterr().err
    taken = signals.take(signals.STOP_SIGNALS, 0)
    assert taken is not None and taken.signum == signal.SIGTERM and taken.pid == 1
