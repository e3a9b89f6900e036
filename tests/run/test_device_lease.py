"""Runs from different runs folders on one host's devices (issue 63), through the real launcher: its supervisor,
torchrun, fake ranks, the lease's kernel locks, signals.

No GPU is here, so two things are stood in for, and only these: the GPUs torch would count (a ``sitecustomize``
on the launcher's PYTHONPATH makes ``launcher.config.backend.device_count("cuda")`` answer 4), and nvidia-smi (a script
answering the launcher's two queries from recorded output, tests/support/files). The ranks are fake (they use no
device), so a run that trains to its end ends FAILED_ACCEPTANCE (its adapter is a stand-in), as every fake run does.
"""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from launcher.errors import ExitCode
from tests.state.test_devices import standin_env
from tests.support.fake_runs import (
    PREFLIGHT_SKIP,
    fake_config,
    kill_all,
    launcher,
    launcher_bg,
    processes_naming,
    rank_processes,
    read_status,
    wait_for,
    wait_for_run_dir,
)

GPUS = "\n".join(
    [
        "import launcher.config.backend as _b",
        "_count = _b.device_count",
        "_b.device_count = lambda name: 4 if name == 'cuda' else _count(name)",
        "",
    ]
)
# rows that read the machine's own CUDA stack, which is not here
SKIP = f"{PREFLIGHT_SKIP},backend,shm,packages,triton,memory"


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    yield
    kill_all(processes_naming(str(tmp_path)))


def cuda_run(tmp_path, demo_assets, name: str, visible: str, spec: dict) -> tuple:
    """A config of backend cuda in its own runs folder, and the environment that selects ``visible``."""
    folder = tmp_path / name
    folder.mkdir()
    cfg, env = fake_config(
        folder, demo_assets, {"quiet": True, **spec}, backend="cuda", output_root=str(tmp_path / f"runs-{name}")
    )
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(GPUS)
    env = {
        **env,
        **standin_env(tmp_path, apps=""),
        "CUDA_VISIBLE_DEVICES": visible,
        "LAUNCHER_LEASE_DIR": str(tmp_path / "leases"),
        "LAUNCHER_PREFLIGHT_SKIP": SKIP,
        "PYTHONPATH": os.pathsep.join((str(hook), env["PYTHONPATH"])),
    }
    return cfg, env


@pytest.mark.slow
def test_runs_of_two_runs_folders_share_the_host_by_device_and_never_overlap(tmp_path, demo_assets):
    """Run A (runs folder a, GPU 0) trains; run B (runs folder b, GPU 1) starts beside it and trains to its end;
    run C (runs folder c, GPU 0) is refused at once with exit 3, naming A, its runs folder, user and devices, and
    leaves nothing on disk; A's supervisor SIGKILLed frees its lease at once."""
    cfg_a, env_a = cuda_run(tmp_path, demo_assets, "a", "0", {"lines": 400, "interval": 0.2})
    supervisor = launcher_bg("run", cfg_a, env=env_a, log=tmp_path / "a.out")
    run_a = wait_for_run_dir(tmp_path / "runs-a")
    rank_processes(run_a, 1)
    status_a = read_status(run_a)
    assert status_a["devices"] == [{"host_index": "0", "identity": "cuda:GPU-5d1b3a2e-0000-4c1a-9d2f-000000000000"}]
    preflight = json.loads((run_a / "preflight.json").read_text())
    (row,) = [c for c in preflight["checks"] if c["name"] == "devices"]
    assert row["status"] == "ok" and "cuda:GPU-5d1b3a2e-0000" in row["detail"], row

    cfg_b, env_b = cuda_run(tmp_path, demo_assets, "b", "1", {"lines": 3, "interval": 0.1})
    ended_b = launcher("run", cfg_b, "--quiet", env=env_b, timeout=600)
    run_b = next(p for p in (tmp_path / "runs-b").iterdir() if (p / "status.json").is_file())
    status_b = read_status(run_b)
    assert status_b["state"] == "FAILED_ACCEPTANCE" and "lease" not in (status_b["reason"] or ""), status_b
    assert status_b["progress"]["step"] == 3 and status_b["devices"][0]["host_index"] == "1", ended_b.stderr

    cfg_c, env_c = cuda_run(tmp_path, demo_assets, "c", "0", {"lines": 3})
    refused = launcher("run", cfg_c, "--quiet", env=env_c, timeout=300)
    assert refused.returncode == ExitCode.REFUSED, refused.stderr
    said = refused.stderr
    assert f"is leased by run {run_a.name} of user {psutil.Process().username()}" in said, said
    assert f"runs folder {tmp_path / 'runs-a'}" in said and "devices 0," in said, said
    assert f"`launcher stop {run_a.name} --root {tmp_path / 'runs-a'}`" in said, said
    assert not (tmp_path / "runs-c").exists() or not [p for p in (tmp_path / "runs-c").iterdir() if p.is_dir()]

    listed = launcher("list", "--devices", env=env_a, timeout=60)
    assert run_a.name in listed.stdout and "cuda:GPU-5d1b3a2e-0000" in listed.stdout, listed.stdout

    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait(timeout=60)
    listed = launcher("list", "--devices", env=env_a, timeout=60)
    assert "no device is leased" in listed.stdout, listed.stdout  # the kernel dropped the dead holder's lock
    stopped = launcher("stop", run_a, env=env_a, timeout=300)  # its orphaned job: cleaned up as ever
    assert stopped.returncode in (0, ExitCode.FAILED), stopped.stderr
    wait_for("A's job gone", lambda: not processes_naming(str(run_a)), timeout=120)
