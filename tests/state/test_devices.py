"""Device identities, occupancy and leases (issue 63).

No GPU or NPU is here: nvidia-smi and npu-smi are stood in for by their recorded outputs (tests/support/files:
``npu-smi info`` of a 910B server as npu-smi 24.1 prints it, nvidia-smi's CSV answers to the two queries the launcher
makes) and, where a process must run the tool, by ``nvidia-smi-standin.sh`` on PATH. The leases are real: kernel
locks taken by real processes, killed with real signals.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launcher.checks.devices import check_devices
from launcher.errors import ExitCode, LauncherError
from launcher.state.devices import Device, DeviceError, parse_npu_smi, parse_nvidia_smi, run_devices
from launcher.state.lease import DeviceLease, LeaseBusy, list_leases
from tests.support.common import REPO
from tests.support.fake_runs import wait_for

FILES = REPO / "tests" / "support" / "files"
GPU2 = "cuda:GPU-5d1b3a2e-2222-4c1a-9d2f-222222222222"


def standin_env(tmp_path: Path, apps: str | None = None) -> dict[str, str]:
    """PATH with the stand-in nvidia-smi first, answering from copies of the recorded CSV."""
    smi = tmp_path / "smi"
    (smi / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(FILES / "nvidia-smi-standin.sh", smi / "bin" / "nvidia-smi")
    shutil.copy(FILES / "nvidia-smi-gpus.csv", smi / "gpus.csv")
    (smi / "apps.csv").write_text((FILES / "nvidia-smi-apps.csv").read_text() if apps is None else apps)
    return {**os.environ, "PATH": f"{smi / 'bin'}{os.pathsep}{os.environ['PATH']}", "STANDIN_SMI_DIR": str(smi)}


def test_nvidia_smi_answers_give_each_gpu_its_uuid_memory_and_processes() -> None:
    gpus = parse_nvidia_smi((FILES / "nvidia-smi-gpus.csv").read_text(), (FILES / "nvidia-smi-apps.csv").read_text())
    assert [g.host_index for g in gpus] == ["0", "1", "2", "3"]
    assert gpus[2].identity == GPU2 and gpus[2].bus_id == "00000000:3a:00.0"
    assert gpus[2].used_mib == 61320 and gpus[2].total_mib == 81559
    (proc,) = gpus[2].processes
    assert (proc.pid, proc.name, proc.used_mib) == (2406311, "python3", 61312)
    assert all(not g.processes for g in (gpus[0], gpus[1], gpus[3]))


def test_npu_smi_info_gives_each_npu_its_bus_id_hbm_and_processes() -> None:
    npus = parse_npu_smi((FILES / "npu-smi-info-910b.txt").read_text())
    assert [n.host_index for n in npus] == ["0", "1", "2", "3"]
    assert [n.identity for n in npus] == [
        "npu:0000:c1:00.0",
        "npu:0000:c2:00.0",
        "npu:0000:81:00.0",
        "npu:0000:82:00.0",
    ]
    assert (npus[2].used_mib, npus[2].total_mib) == (57895, 65536)
    (proc,) = npus[2].processes
    assert (proc.pid, proc.name, proc.used_mib) == (1712733, "python3", 54577)
    assert not npus[0].processes and not npus[3].processes


def test_the_visible_devices_name_the_devices_by_position_or_uuid(tmp_path: Path) -> None:
    env = standin_env(tmp_path)
    picked = run_devices("cuda", 2, {**env, "CUDA_VISIBLE_DEVICES": "3,1"})
    assert [d.host_index for d in picked] == ["3", "1"]
    assert [d.identity for d in run_devices("cuda", 1, {**env, "CUDA_VISIBLE_DEVICES": "GPU-5d1b3a2e-2222"})] == [GPU2]
    assert [
        d.host_index for d in run_devices("cuda", 2, {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"})
    ] == ["0", "1"]
    with pytest.raises(DeviceError, match=r"CUDA_VISIBLE_DEVICES=0,7 names device '7', which is not among the 4"):
        run_devices("cuda", 2, {**env, "CUDA_VISIBLE_DEVICES": "0,7"})
    bare = {**os.environ, "PATH": str(tmp_path / "nothing"), "CUDA_VISIBLE_DEVICES": "0-1"}
    indexed = run_devices("cuda", 2, bare)  # no tool: known by index, and said so
    assert [d.identity for d in indexed] == ["cuda:index:0", "cuda:index:1"] and "not found" in indexed[0].note


class Launcher:
    """The launcher's part of the devices row: its two keys."""

    def __init__(self, nproc: int, busy_gib: float = 2.0, allow: bool = False):
        self.nproc_per_node, self.busy_device_gib, self.allow_busy_devices = nproc, busy_gib, allow


def test_the_devices_row_names_another_process_and_fails_unless_allowed(tmp_path: Path) -> None:
    env = {**standin_env(tmp_path), "CUDA_VISIBLE_DEVICES": "1,2"}
    status, detail, free = check_devices("cuda", Launcher(2), env)
    assert status == "fail" and "pid 2406311 (python3) holds 59.9 GiB" in detail, detail
    assert "launcher.allow_busy_devices: true" in detail and free == pytest.approx((81559 - 61320) / 1024)
    status, detail, _ = check_devices("cuda", Launcher(2, allow=True), env)
    assert status == "warn" and "shared" in detail
    status, detail, free = check_devices("cuda", Launcher(2), {**env, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert status == "ok" and "no process" in detail and free == pytest.approx((81559 - 4) / 1024)
    assert check_devices("cpu", Launcher(1))[0] == "ok"


# --- leases, held by real processes ---------------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from launcher.state.lease import DeviceLease
from launcher.state.devices import Device
folder, root, run = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
devices = [Device("cuda", i, f"cuda:GPU-{i}") for i in sys.argv[4].split(",")]
lease = DeviceLease(devices, folder).acquire(root)
lease.describe(run, root / run, root)
print("held", flush=True)
time.sleep(600)
"""


def hold(folder: Path, root: Path, run: str, devices: str, user: int | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), str(root), run, devices],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        user=user,
    )
    return proc


def devices(*indices: str) -> list[Device]:
    return [Device("cuda", i, f"cuda:GPU-{i}") for i in indices]


def test_leases_keep_runs_on_disjoint_devices_apart_name_the_holder_and_free_at_sigkill(tmp_path: Path) -> None:
    folder = tmp_path / "leases"
    first = hold(folder, tmp_path / "runs-a", "run-a", "0,1")
    try:
        assert first.stdout.readline() == "held\n", first.stderr.read()
        DeviceLease(devices("2", "3"), folder).acquire(tmp_path / "runs-b").release()  # disjoint: side by side
        before = sorted(p.name for p in folder.iterdir())
        with pytest.raises(LeaseBusy) as info:
            DeviceLease(devices("3", "1"), folder).acquire(tmp_path / "runs-c")
        message = str(info.value)
        assert info.value.exit_code == ExitCode.REFUSED
        assert "device 1 (cuda:GPU-1) is leased by run run-a of user" in message, message
        assert f"runs folder {tmp_path / 'runs-a'}" in message and "devices 0, 1" in message
        assert f"`launcher stop run-a --root {tmp_path / 'runs-a'}`" in message
        assert sorted(p.name for p in folder.iterdir()) == before  # the refused run left nothing
        assert [lease["run_id"] for lease in list_leases(folder)] == ["run-a", "run-a"]
        free = DeviceLease(devices("3"), folder).acquire(tmp_path / "runs-c")  # what a refusal took is given back
        free.release()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
        DeviceLease(devices("0", "1"), folder).acquire(tmp_path / "runs-d").release()  # free at once
        assert list_leases(folder) == []
    finally:
        first.kill()
        first.wait()


def test_launcher_list_devices_shows_who_holds_what(tmp_path: Path) -> None:
    folder = tmp_path / "leases"
    holder = hold(folder, tmp_path / "runs-a", "run-a", "0")
    try:
        assert holder.stdout.readline() == "held\n"
        env = {**os.environ, "LAUNCHER_LEASE_DIR": str(folder)}
        shown = subprocess.run(
            [sys.executable, "-m", "launcher", "list", "--devices"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        rows = shown.stdout.splitlines()
        assert shown.returncode == 0 and len(rows) == 2, shown
        assert rows[1].split()[:3] == ["0", "cuda:GPU-0", "run-a"] and str(tmp_path / "runs-a") in rows[1]
    finally:
        holder.kill()
        holder.wait()


def test_bad_lease_files_give_one_clear_message(tmp_path: Path) -> None:
    folder = tmp_path / "leases"
    DeviceLease(devices("0"), folder).acquire(tmp_path / "runs").release()
    (lock,) = folder.glob("*.lock")
    owner = folder / f"{lock.stem}.owner-{os.getuid()}.json"
    owner.write_text("{garbage")  # a damaged owner file: the lock still decides, the message says so
    holder = hold(folder, tmp_path / "runs-a", "run-a", "0")
    try:
        assert holder.stdout.readline() == "held\n"
        owner.write_text("{garbage")
        with pytest.raises(LeaseBusy, match="leased by a process that has not written who it is"):
            DeviceLease(devices("0"), folder).acquire(tmp_path / "runs-b")
    finally:
        holder.kill()
        holder.wait()
    lock.unlink()
    lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(LauncherError, match=r"is a symbolic link \(to .*elsewhere\).*Remove the link") as info:
        DeviceLease(devices("0"), folder).acquire(tmp_path / "runs")
    assert info.value.exit_code == ExitCode.USAGE and "\n" not in str(info.value)
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(LauncherError, match=r"the device lease folder .*a-file cannot be used \(not a folder\)"):
        DeviceLease(devices("0"), tmp_path / "a-file").acquire(tmp_path / "runs")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: a lease file of another user and a run as that user")
def test_another_users_lease_file_that_cannot_be_opened_is_one_clear_message(tmp_path: Path, request) -> None:
    """A lease file left by root with mode 0600 (as an old tool could leave it): a run of user nobody cannot open it
    and says whose it is and how to fix it, in one line."""
    top = Path(tempfile.mkdtemp(prefix="lease-test-"))  # pytest's own folders are root's alone (0700)
    os.chmod(top, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(top))
    folder = top / "leases"
    DeviceLease(devices("0"), folder).acquire(tmp_path / "runs").release()
    (lock,) = folder.glob("*.lock")
    os.chmod(lock, 0o600)
    code, said = as_user(65534, lambda: DeviceLease(devices("0"), folder).acquire(tmp_path / "runs").release())
    assert code == ExitCode.USAGE, said
    assert "Permission denied" in said and "the file belongs to root" in said, said
    assert f"chmod 666 {lock}" in said and "\n" not in said


def as_user(uid: int, action) -> tuple[int, str]:
    """``action()`` in a forked child that gives up root for ``uid`` (no new interpreter to find): its exit code (0,
    or a LauncherError's) and what it said."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        code, said = 0, ""
        try:
            os.setgid(uid)
            os.setuid(uid)
            action()
        except LauncherError as err:
            code, said = err.exit_code, str(err)
        except BaseException as err:  # noqa: BLE001  (reported to the parent, which fails the test)
            code, said = 99, repr(err)
        os.write(write, said.encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status), said


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: runs as two other users")
def test_a_lease_one_user_made_is_taken_by_another_once_free(request) -> None:
    """Two users of one host, one after the other on the same device: the lease file the first made (in the sticky
    folder, owned by them) serves the second; while the first holds it, the second is refused naming them."""
    top = Path(tempfile.mkdtemp(prefix="lease-users-"))
    os.chmod(top, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(top))
    folder = top / "leases"
    DeviceLease([], folder).acquire(top)  # nothing to lease: the folder is not even made
    assert not folder.exists()
    os.mkdir(folder)
    os.chmod(folder, 0o1777)
    first, second = 1001, 1002
    assert as_user(first, lambda: DeviceLease(devices("0"), folder).acquire(top).release()) == (0, "")
    (lock,) = folder.glob("*.lock")
    assert lock.stat().st_uid == first and oct(lock.stat().st_mode & 0o777) == "0o666"
    assert as_user(second, lambda: DeviceLease(devices("0"), folder).acquire(top).release()) == (0, "")
    holder = DeviceLease(devices("0"), folder).acquire(top)  # root holds it now: the second user is refused
    try:
        code, said = as_user(second, lambda: DeviceLease(devices("0"), folder).acquire(top))
        assert code == ExitCode.REFUSED and "is leased by" in said, said
    finally:
        holder.release()


def test_the_leases_are_recorded_in_a_file_the_owner_can_read(tmp_path: Path) -> None:
    folder = tmp_path / "leases"
    lease = DeviceLease(devices("0"), folder).acquire(tmp_path / "runs")
    try:
        lease.describe("run-x", tmp_path / "runs" / "run-x", tmp_path / "runs")
        (owner,) = folder.glob("*.owner-*.json")
        data = json.loads(owner.read_text())
        assert data["run_id"] == "run-x" and data["device"] == "cuda:GPU-0" and data["host_indices"] == ["0"]
        assert oct(folder.stat().st_mode & 0o7777) == "0o1777"
    finally:
        lease.release()
    wait_for("the lease given back", lambda: list_leases(folder) == [], timeout=10)


def test_the_default_lease_folder_is_the_one_compose_mounts_into_every_container() -> None:
    import yaml

    from launcher.state.lease import DEFAULT_LEASE_DIR

    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    (volume,) = [v for v in compose["x-run-volumes"] if v["target"] == str(DEFAULT_LEASE_DIR)]
    assert DEFAULT_LEASE_DIR.is_absolute() and volume["source"] == f"${{LAUNCHER_LEASE_DIR:-{DEFAULT_LEASE_DIR}}}"
    for name, service in compose["services"].items():
        assert any(v["target"] == str(DEFAULT_LEASE_DIR) for v in service["volumes"]), name
