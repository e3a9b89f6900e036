"""The cpu image and compose's ``train-cpu`` service against a real Docker engine and real containers.

Enabled by ``LAUNCHER_DOCKER_TESTS=1`` (``.ci/run`` installs and starts an engine and sets it):

- unset, the module is skipped with the reason (an engine may or may not answer; building the image takes
  minutes, so a plain ``bash scripts/test.sh`` never starts it on its own);
- set, every test needs an engine: if none answers they fail, they are never skipped.

Once per session: the cpu wheelhouse (``docker/wheelhouse.py download``), then the README's offline build
``scripts/build-image.sh cpu``: the local Debian base image (``scripts/docker-base-image.sh``, rebuilt when
missing) and the image (``docker compose --profile cpu build train-cpu``, offline from that wheelhouse).
Every test then runs the service with the commands docs/containers.md shows, on its own host folders, and
waits for conditions (files, ``docker inspect``) with deadlines; nothing sleeps a fixed time.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from launcher.errors import ExitCode
from tests.support import fake_runs
from tests.support.engine import BASE_IMAGE, ENABLE, ROOT, compose_names, docker_cli, project_context

# nothing tolerated: an engine error, or a status answer that is not JSON, is what these tests look at
wait_for = partial(fake_runs.wait_for, tolerate=())
# compose's name for train-cpu's container in this checkout (<project>-train-cpu-1; compose.yaml, "Names on a
# shared engine"): asked of compose only when these tests are on (compose may be absent otherwise)
CONTAINER = compose_names()[1] if os.environ.get(ENABLE) == "1" else "<project>-train-cpu-1"
NONROOT = (1000, 1000)
DEMO = yaml.safe_load((ROOT / "configs" / "demo_cpu.yaml").read_text())

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        os.environ.get(ENABLE) != "1",
        reason=f"real-engine container tests are off: set {ENABLE}=1 with a Docker engine running "
        "(bash scripts/docker-engine.sh install && bash scripts/docker-engine.sh start; .ci/run does both)",
    ),
]


# --- per test: host folders and compose ---------------------------------------------------------------


class Compose:
    """``docker compose --profile cpu ...`` in the repository (or in ``checkout``, a folder holding the compose file),
    with this test's host folders."""

    def __init__(self, root: Path, checkout: Path = ROOT):
        self.root, self.checkout = root, checkout
        self.outputs, self.logs = root / "outputs", root / "logs"
        self.models, self.data = root / "models", root / "data"
        for folder in (self.outputs, self.logs, self.models, self.data):
            folder.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "OUTPUTS_DIR": str(self.outputs),
            "LOGS_DIR": str(self.logs),
            "MODEL_DIR": str(self.models),
            "DATA_DIR": str(self.data),
            "CPU_BASE_IMAGE": BASE_IMAGE,
        }
        for name in ("UID", "GID", "DEVICE_GID", "TRAIN_CONFIG_CPU", "WHEELHOUSE"):
            self.env.pop(name, None)

    def cmd(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 900, check: bool = False
    ) -> subprocess.CompletedProcess:
        full = [docker_cli(), "compose", "--profile", "cpu", *args]
        out = subprocess.run(
            full, cwd=self.checkout, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert out.returncode == 0, f"{' '.join(args)}: {out.stdout[-3000:]}{out.stderr[-3000:]}"
        return out

    def runs(self) -> list[Path]:
        return sorted(p.parent for p in (self.outputs / "runs").glob("*/status.json"))

    def status(self, run: Path) -> dict[str, Any]:
        try:
            return json.loads((run / "status.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def long_config(self, **overrides: Any) -> str:
        """A demo config with many steps, in the outputs folder; returns its path in the container."""
        data = {**DEMO, "max_steps": 400, "save_steps": 1000, "eval_steps": 1000, **overrides}
        (self.outputs / "demo_long.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        return "/outputs/demo_long.yaml"


@pytest.fixture
def compose(cpu_image, engine, tmp_path) -> Iterator[Compose]:
    c = Compose(tmp_path)
    c.cmd("rm", "--force", "--stop", "train-cpu")
    yield c
    c.cmd("down", "--timeout", "30", "--remove-orphans")
    # root-owned files from the container: make the folder removable by pytest's tmp cleanup
    subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(tmp_path)], check=False)


def container_processes(run_dir_in_container: str) -> list[psutil.Process]:
    """Host processes (containers' processes are host processes) whose command line names the run."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if run_dir_in_container in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            pass
    return found


# --- tests ------------------------------------------------------------------------------------------


def launcher_on_host(
    *args: Any, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The host's ``launcher`` (this checkout), reading the mounted outputs folder."""
    return subprocess.run(
        [sys.executable, "-m", "launcher", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_up_trains_the_demo_to_succeeded(compose: Compose, engine, cpu_image) -> None:
    digest = engine.images.get(cpu_image).id  # what the engine reports; compose passes it to the launcher
    out = compose.cmd(
        "up", "--exit-code-from", "train-cpu", "train-cpu", env={"LAUNCHER_IMAGE_DIGEST": digest}, timeout=900
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    (run,) = compose.runs()
    status = compose.status(run)
    assert status["state"] == "SUCCEEDED" and status["exit_code"] == 0
    assert status["container"]["name"] == CONTAINER and status["backend"] == "cpu"
    container_id = engine.containers.get(CONTAINER).id
    assert status["container"]["id"] == container_id and status["trainer_log"] == "output/trainer_log.jsonl"
    adapter = run / "output" / "adapter_model.safetensors"
    assert adapter.is_file() and adapter.stat().st_size > 0
    steps = [json.loads(line) for line in (run / "output" / "trainer_log.jsonl").read_text().splitlines()]
    assert any(r.get("current_steps") == DEMO["max_steps"] for r in steps)
    manifest = json.loads((run / "manifest.json").read_text())
    image = manifest["image"]
    assert image["tag"] == cpu_image and image["base"] == BASE_IMAGE  # LAUNCHER_IMAGE, LAUNCHER_BASE_IMAGE
    assert image["digest"] == digest and manifest["container"]["image"]["digest"] == digest
    # readable by a user on the host who is not root: records, the adapter, the trainer log
    for path in (run / "status.json", adapter, run / "output" / "trainer_log.jsonl", run / "verify.json"):
        assert path.stat().st_mode & 0o004, f"{path} {oct(path.stat().st_mode)}"
    # the host reads the container's run (written under /outputs) from where it is mounted here; the model
    # lives in the image, so the host gives its own copy of the demo model (the same deterministic build)
    built = launcher_on_host("demo-assets", "--out", compose.root / "host-demo", timeout=300)
    assert built.returncode == 0, built.stderr
    shown = launcher_on_host("verify", run, "--model", compose.root / "host-demo" / "model")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert launcher_on_host("report", run, "--no-plot").returncode == 0
    info = json.loads(launcher_on_host("status", run, "--json").stdout)
    assert info["state"] == "SUCCEEDED" and info["step"] == DEMO["max_steps"] and info["last_checkpoint"]
    # evaluate from the host: the model and data live in the image, not in a mount: refused in one line with the
    # command that evaluates the run in its image; that command works; so do the host's copies
    refused = launcher_on_host("evaluate", run, "--max-prompts", "2", timeout=300)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stdout + refused.stderr
    command = refused.stderr.rstrip().rsplit(": ", 1)[1]
    assert command == (
        f"docker compose --profile cpu run --rm train-cpu launcher evaluate /outputs/runs/{run.name} --max-prompts=2"
    ), refused.stderr
    in_image = compose.cmd(*shlex.split(command)[2:], timeout=900)
    assert in_image.returncode == 0, in_image.stdout[-3000:] + in_image.stderr[-3000:]
    assert json.loads((run / "evaluate.json").read_text())["run_id"] == run.name
    (run / "evaluate.json").unlink()
    host_demo = compose.root / "host-demo"
    here = launcher_on_host(
        "evaluate",
        run,
        "--max-prompts",
        "2",
        "--model",
        host_demo / "model",
        "--data-dir",
        host_demo / "data",
        timeout=600,
    )
    assert here.returncode == 0, here.stdout[-3000:] + here.stderr[-3000:]
    assert (run / "evaluate.json").is_file()


def test_overrides_through_compose_evaluate_through_the_mounts_and_the_new_run_at_once(
    compose: Compose, engine
) -> None:
    """TRAIN_OVERRIDES: a bad key stops the container in one message naming it; good ones (the model and data
    mounted from the host, 2 steps) train and are recorded. The host's `evaluate` finds the container's model and
    data through the container's mounts. Right after `up -d`, the host's `status` without RUN waits for the new
    run's folder instead of showing the previous run."""
    built = launcher_on_host("demo-assets", "--out", compose.root / "assets", timeout=300)
    assert built.returncode == 0, built.stderr
    mounts = {"MODEL_DIR": str(compose.root / "assets" / "model"), "DATA_DIR": str(compose.root / "assets" / "data")}
    bad = compose.cmd(
        "up", "--exit-code-from", "train-cpu", "train-cpu", env={**mounts, "TRAIN_OVERRIDES": "max_step=2"}, timeout=900
    )
    assert bad.returncode == 2, bad.stdout[-3000:] + bad.stderr[-3000:]
    said = engine.containers.get(CONTAINER).logs().decode(errors="replace")  # what the launcher printed
    assert (
        "max_step: not a LLaMA-Factory argument; did you mean max_steps? (set by LAUNCHER_OVERRIDES, compose's "
        "TRAIN_OVERRIDES)"
    ) in said, said[-3000:]
    assert compose.runs() == []
    overrides = "model_name_or_path=/models/Qwen3.5-27B dataset_dir=/data max_steps=2 save_steps=2 eval_steps=2"
    up = compose.cmd(
        "up", "--exit-code-from", "train-cpu", "train-cpu", env={**mounts, "TRAIN_OVERRIDES": overrides}, timeout=900
    )
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    (run,) = compose.runs()
    assert yaml.safe_load((run / "overrides.yaml").read_text())["max_steps"] == 2
    steps = [json.loads(line) for line in (run / "output" / "trainer_log.jsonl").read_text().splitlines()]
    assert {r["total_steps"] for r in steps} == {2}
    root = compose.outputs / "runs"
    evaluated = launcher_on_host("evaluate", "--root", root, "--max-prompts", "2", timeout=600)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    doc = json.loads((run / "evaluate.json").read_text())
    assert doc["run_id"] == run.name and doc["test_split"]["path"].startswith(mounts["DATA_DIR"]), doc["test_split"]

    compose.cmd(
        "up", "--detach", "train-cpu", env={**mounts, "TRAIN_OVERRIDES": overrides.replace("=2 ", "=400 ")}, check=True
    )
    from launcher.run.lock import read_owner

    def new_holder() -> dict[str, Any] | None:  # the first run's supervisor left its owner file naming that run
        owner = read_owner(root)
        return owner if owner and owner.get("run_id") != run.name else None

    owner = wait_for("the new supervisor to hold the lock", new_holder, timeout=300)
    shown = launcher_on_host("status", "--root", root, "--json", timeout=600)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    (new,) = [p for p in compose.runs() if p != run]
    assert json.loads(shown.stdout)["run_id"] == new.name, (owner, shown.stdout)
    if owner.get("run_id") is None:  # asked while the config was being checked: it waited and said so
        assert shown.stderr.startswith(f"waiting for the run being set up under {root}"), shown.stderr


@pytest.fixture(scope="module")
def live_run(cpu_image, engine, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A long demo run, detached (`up -d`), once it is RUNNING and has logged a training step."""
    c = Compose(tmp_path_factory.mktemp("live"))
    c.cmd("rm", "--force", "--stop", "train-cpu")
    config = c.long_config()
    c.cmd("up", "--detach", "train-cpu", env={"TRAIN_CONFIG_CPU": config}, check=True)
    run = wait_for("the run folder", lambda: (c.runs() or [None])[0], timeout=300)

    def stepping() -> bool:
        log = run / "output" / "trainer_log.jsonl"
        return c.status(run).get("state") == "RUNNING" and log.is_file() and log.stat().st_size > 0

    wait_for("the run to be RUNNING with a logged step", stepping, timeout=600)
    yield {"compose": c, "run": run, "config": config}
    c.cmd("down", "--timeout", "30", "--remove-orphans")
    subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(c.root)], check=False)


@pytest.fixture(scope="module")
def refused(live_run) -> subprocess.CompletedProcess:
    """A second container (`docker compose run`) on the live run's outputs folder, asked to train."""
    return live_run["compose"].cmd("run", "--rm", "train-cpu", "launcher", "run", live_run["config"], timeout=300)


def test_second_container_on_the_same_outputs_is_refused_by_the_run_lock(live_run, refused, engine) -> None:
    c, run = live_run["compose"], live_run["run"]
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0, text[-3000:]
    assert "another run is live" in text, text[-3000:]
    assert len(c.runs()) == 1  # the refused container created no run folder
    assert engine.containers.get(CONTAINER).status == "running"  # the live run is untouched
    assert c.status(run)["state"] == "RUNNING"


def test_the_refusal_names_the_live_run(live_run, refused) -> None:
    text = refused.stdout + refused.stderr
    assert live_run["run"].name in text, text[-1500:]


def test_the_host_watches_a_detached_run_through_the_engine(live_run, engine) -> None:
    """`up -d`, then on the host: status shows RUNNING with step progress and the container's state (its pids
    live in the container's namespace; the engine vouches for them), and `logs -f` follows it."""
    c, run = live_run["compose"], live_run["run"]

    def paced() -> dict[str, Any] | None:  # the ETA needs a logged step past the first second of the attempt
        info = json.loads(launcher_on_host("status", run, "--json").stdout)
        return info if info["step"] is not None and info["eta_s"] is not None else None

    info = wait_for("a status with step progress and an ETA", paced, timeout=300, every=1.0)
    assert info["state"] == "RUNNING" and info["liveness"] == "live", info
    assert info["container_state"] == "running" and info["container"]["name"] == CONTAINER
    assert info["total_steps"] == 400, info
    listed = launcher_on_host("list", "--root", c.outputs / "runs")
    assert run.name in listed.stdout and "RUNNING" in listed.stdout
    env_root = subprocess.run(
        [sys.executable, "-m", "launcher", "status"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "LAUNCHER_ROOT": str(c.outputs / "runs")},
        timeout=120,
    )
    assert run.name in env_root.stdout and "running" in env_root.stdout


@pytest.fixture(scope="module")
def follower(live_run) -> subprocess.Popen:
    """`launcher logs -f` on the host, started while the run lives (the stop below ends it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "logs", "-f", live_run["run"]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()


def test_compose_stop_mid_run_records_terminated_within_the_grace_period(live_run, engine, follower) -> None:
    c, run = live_run["compose"], live_run["run"]
    in_container = c.status(run)["run_dir"]
    assert container_processes(in_container), "no host process names the run: the check below would be empty"
    grace = engine.containers.get(CONTAINER).attrs["Config"].get("StopTimeout")
    started = time.monotonic()
    c.cmd("stop", "train-cpu", timeout=900, check=True)
    took = time.monotonic() - started
    state = engine.containers.get(CONTAINER).attrs["State"]
    assert not state["Running"] and state["ExitCode"] != 137 and not state["OOMKilled"], state
    assert took < 120, f"docker compose stop took {took:.0f}s (stop_grace_period {grace}s)"
    status = c.status(run)
    assert status["state"] == "TERMINATED", status
    assert status["ended"] is not None
    from launcher.run.lock import is_locked

    assert not is_locked(c.outputs / "runs")
    assert container_processes(in_container) == []
    # the host's `logs -f` followed the job to its end and stopped by itself
    out, _ = follower.communicate(timeout=120)
    assert follower.returncode == 0 and "'loss'" in out, out[-2000:]  # LLaMA-Factory's lines from the job log
    host = json.loads(launcher_on_host("status", run, "--json").stdout)
    assert host["state"] == "TERMINATED" and host["recorded_state"] == "TERMINATED"


def test_a_killed_container_is_node_lost_and_a_new_up_is_allowed_with_a_warning(cpu_image, engine, tmp_path) -> None:
    c = Compose(tmp_path)
    c.cmd("rm", "--force", "--stop", "train-cpu")
    config = c.long_config()
    try:
        c.cmd("up", "--detach", "train-cpu", env={"TRAIN_CONFIG_CPU": config}, check=True)
        run = wait_for("the run folder", lambda: (c.runs() or [None])[0], timeout=300)
        wait_for(
            "a logged step",
            lambda: c.status(run).get("state") == "RUNNING" and (run / "output" / "trainer_log.jsonl").is_file(),
            timeout=600,
        )
        engine.containers.get(CONTAINER).kill()
        wait_for("the container to stop", lambda: engine.containers.get(CONTAINER).status == "exited", timeout=60)
        info = json.loads(launcher_on_host("status", run, "--json").stdout)
        assert info["state"] == "NODE_LOST" and info["recorded_state"] == "RUNNING", info
        assert f"container {CONTAINER} is exited" in info["note"]
        # a new `up`: the lock was freed with the killed supervisor; the new one records the old run and warns
        c.cmd("up", "--detach", "train-cpu", env={"TRAIN_CONFIG_CPU": config}, check=True)
        wait_for("the second run", lambda: len(c.runs()) == 2, timeout=300)
        wait_for("the old run recorded NODE_LOST", lambda: c.status(run).get("state") == "NODE_LOST", timeout=120)
        logs = engine.containers.get(CONTAINER).logs().decode(errors="replace")
        assert f"warning: run {run.name}:" in logs and "recorded NODE_LOST" in logs, logs[-3000:]
        # compose restarted the same container (same id): the new supervisor sees its container began after
        # the old run's supervisor did
        assert "container was restarted since the run was recorded live" in c.status(run)["reason"]
    finally:
        c.cmd("down", "--timeout", "30", "--remove-orphans")
        subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(tmp_path)], check=False)


STEPS = 100  # of the detached runs that the host stops (and resumes)


@pytest.fixture
def detached(cpu_image, engine, tmp_path) -> Iterator[tuple[Compose, Path]]:
    """A long demo run, detached (`up -d`), once its job has logged a step and can save on a stop."""
    c = Compose(tmp_path)
    c.cmd("rm", "--force", "--stop", "train-cpu")
    try:
        # 100 steps: the stop lands long before the end, and the resumed attempt finishes on a loaded machine
        c.cmd("up", "--detach", "train-cpu", env={"TRAIN_CONFIG_CPU": c.long_config(max_steps=STEPS)}, check=True)
        run = wait_for("the run folder", lambda: (c.runs() or [None])[0], timeout=300)
        wait_for(
            "a logged step and the job's save-on-stop handshake",
            lambda: (
                c.status(run).get("state") == "RUNNING"
                and (run / "output" / "trainer_log.jsonl").is_file()
                and (run / "save_on_stop.json").is_file()
            ),
            timeout=600,
        )
        yield c, run
    finally:
        c.cmd("down", "--timeout", "30", "--remove-orphans")
        subprocess.run([docker_cli(), "rm", "--force", f"{CONTAINER}-resume"], capture_output=True, check=False)
        subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(tmp_path)], check=False)


def _ended_events(run: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("event") == "ended"]


def test_host_stop_saves_through_the_engine_and_host_resume_finishes_the_run(detached, engine) -> None:
    """`launcher stop` on the host: docker stop through the engine, a checkpoint saved on the stop, the record
    naming it and `launcher stop`; then `launcher resume` on the host: a new attempt in a container made from
    the run's own, to SUCCEEDED at the planned step, in the same run directory."""
    c, run = detached
    stopped = launcher_on_host("stop", run, timeout=900)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    state = engine.containers.get(CONTAINER).attrs["State"]
    assert not state["Running"] and state["ExitCode"] != 137, state
    status = c.status(run)
    assert status["state"] == "CANCELLED", status  # a user's `launcher stop`, as in a host run
    assert status["stopped_by"].startswith("launcher stop (pid ") and f"docker stop {CONTAINER}" in status["stopped_by"]
    saved = status["saved_checkpoint"]
    assert saved and (run / saved["path"]).is_dir(), status
    assert f"checkpoint {saved['path']} saved at step {saved['step']} on the stop" in stopped.stdout, stopped.stdout
    assert len(_ended_events(run)) == 1  # the supervisor's end, and no other
    host = json.loads(launcher_on_host("status", run, "--json").stdout)
    assert host["container_status"] == f"Exited ({state['ExitCode']})", host

    resumed = launcher_on_host("resume", run, "--adapter-only", timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    name = f"{CONTAINER}-resume"
    assert f"in container {name}" in resumed.stdout, resumed.stdout
    wait_for("the resumed run to end", lambda: engine.containers.get(name).status == "exited", timeout=900)
    status = c.status(run)
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 2, status
    assert status["resumed_from"] == saved["path"] and status["container"]["name"] == name, status
    assert c.runs() == [run]
    steps = [json.loads(line) for line in (run / "output" / "trainer_log.jsonl").read_text().splitlines()]
    assert max(r.get("current_steps", 0) for r in steps) == STEPS and saved["step"] < STEPS
    host = json.loads(launcher_on_host("status", run, "--json").stdout)
    assert host["container_name"] == name and host["container_status"] == "Exited (0)", host
    assert f"--root {run.parent}" in resumed.stdout, resumed.stdout  # the follow-ups find the run from anywhere
    # the resume container is none of compose's: its compose labels are empty (a one-off of the project was
    # reported as an orphan), so compose neither lists it nor warns about it
    labels = engine.containers.get(name).labels
    assert not [k for k, v in labels.items() if k.startswith("com.docker.compose.") and v], labels
    listed = c.cmd("ps", "--all", "--format", "{{.Name}}", check=True)
    assert name not in listed.stdout and "orphan" not in listed.stderr, listed.stdout + listed.stderr


def test_host_stop_now_through_the_engine_and_refused_without_one(detached, engine) -> None:
    """Without an engine answer `launcher stop` changes nothing and names the command; `--now` stops the
    container through the engine without a save."""
    c, run = detached
    in_container = c.status(run)["run_dir"]
    refused = launcher_on_host("stop", run, "--now", env={"DOCKER_HOST": f"unix://{c.root}/no-engine.sock"})
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"run: docker exec {CONTAINER} launcher stop {in_container} --now" in refused.stderr, refused.stderr
    assert engine.containers.get(CONTAINER).status == "running"
    assert c.status(run)["state"] == "RUNNING" and _ended_events(run) == []
    stopped = launcher_on_host("stop", run, "--now", timeout=900)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    state = engine.containers.get(CONTAINER).attrs["State"]
    assert not state["Running"] and state["ExitCode"] != 137, state
    status = c.status(run)
    assert status["state"] == "CANCELLED" and status["stopped_by"].startswith("launcher stop (pid "), status
    assert len(_ended_events(run)) == 1
    # the supervisor took the request's --now: no save requested, SIGTERM to the job at once, and the ranks die
    # of it (stopsave.py reads the same request): nothing saved on the stop
    assert status["saved_checkpoint"] is None, status
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    (stopping,) = [e for e in events if e.get("event") == "stopping"]
    assert stopping["save"] is False and stopping["requested_by"] == status["stopped_by"], stopping


def test_security_settings_and_read_only_mounts(compose: Compose, engine) -> None:
    compose.cmd("create", "train-cpu", check=True)
    attrs = engine.containers.get(CONTAINER).attrs
    host = attrs["HostConfig"]
    assert host["Privileged"] is False and host["Init"] is True
    assert "no-new-privileges:true" in host["SecurityOpt"]
    assert not host.get("CapAdd") and not host.get("Devices")
    read_only = {m["Destination"] for m in attrs["Mounts"] if not m["RW"]}
    assert read_only == {"/models/Qwen3.5-27B", "/data", "/opt/launcher/configs"}
    probe = "; ".join(
        f"if touch {d}/probe 2>/dev/null; then echo WROTE {d}; else echo REFUSED {d}; fi"
        for d in sorted(read_only | {"/outputs", "/logs"})
    )
    out = compose.cmd(
        "run", "--rm", "train-cpu", "bash", "-c", probe + "; grep NoNewPrivs /proc/self/status", check=True
    )
    for d in read_only:
        assert f"REFUSED {d}" in out.stdout, out.stdout
    assert "WROTE /outputs" in out.stdout and "WROTE /logs" in out.stdout
    assert re.search(r"NoNewPrivs:\s+1", out.stdout), out.stdout
    assert not any((compose.root / n / "probe").exists() for n in ("models", "data"))


def _pem_bodies(text: str) -> set[str]:
    found = re.findall(r"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", text, re.S)
    return {re.sub(r"\s+", "", body) for body in found}


def _host_added_cas() -> set[str]:
    """Certificates this machine trusts beyond Debian's ca-certificates set (e.g. a proxy's CA)."""
    trusted: set[str] = set()
    for bundle in {os.environ.get("SSL_CERT_FILE", ""), "/etc/ssl/certs/ca-certificates.crt"} - {""}:
        if Path(bundle).is_file():
            trusted |= _pem_bodies(Path(bundle).read_text(errors="replace"))
    for extra in Path("/usr/local/share/ca-certificates").rglob("*.crt"):
        trusted |= _pem_bodies(extra.read_text(errors="replace"))
    standard: set[str] = set()
    for crt in Path("/usr/share/ca-certificates").rglob("*.crt"):
        standard |= _pem_bodies(crt.read_text(errors="replace"))
    return trusted - standard


def test_image_holds_no_ca_or_pip_config_from_the_build_machine(cpu_image, engine) -> None:
    script = (
        "for f in /etc/pip.conf /etc/xdg/pip /root/.pip /root/.config/pip /opt/venv/pip.conf; do "
        "  [ -e $f ] && echo PIPCONF $f; done; "
        "ls /usr/local/share/ca-certificates/ 2>/dev/null | sed 's/^/LOCALCA /'; "
        "find / -xdev -type f \\( -name '*.pem' -o -name '*.crt' \\) -size -2M -exec cat {} + 2>/dev/null"
    )
    text = engine.containers.run(cpu_image, ["bash", "-c", script], remove=True, entrypoint=[]).decode(errors="replace")
    assert "PIPCONF" not in text, [ln for ln in text.splitlines() if ln.startswith("PIPCONF")]
    assert "LOCALCA" not in text, [ln for ln in text.splitlines() if ln.startswith("LOCALCA")]
    added = _host_added_cas()
    assert not added & _pem_bodies(text), "the image holds a CA certificate only the build machine trusts"
    image = engine.images.get(cpu_image)
    env = dict(e.split("=", 1) for e in image.attrs["Config"]["Env"])
    assert not {k for k in env if k.startswith("PIP_") and k != "PIP_DISABLE_PIP_VERSION_CHECK"}, env
    assert not {"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"} & set(env), env
    history = json.dumps(image.history())
    for needle in ("pip.conf", "ca-certificates.crt", "PIP_INDEX_URL", "PIP_CERT", "--cert", "--trusted-host"):
        assert needle not in history, needle


def test_non_root_uid_writes_files_the_host_user_owns(compose: Compose) -> None:
    uid, gid = NONROOT
    ids = {"UID": str(uid), "GID": str(gid)}
    # the host folders belong to root: refused at once, with one message
    refused = compose.cmd("up", "--exit-code-from", "train-cpu", "train-cpu", env=ids, timeout=300)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "entrypoint: /outputs is not writable by uid 1000 gid 1000" in refused.stdout + refused.stderr
    assert compose.runs() == []
    for folder in (compose.outputs, compose.logs):
        os.chown(folder, uid, gid)
    out = compose.cmd("up", "--exit-code-from", "train-cpu", "train-cpu", env=ids, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    (run,) = compose.runs()
    assert compose.status(run)["state"] == "SUCCEEDED"
    written = [p for p in compose.outputs.rglob("*")]
    assert written and all((p.lstat().st_uid, p.lstat().st_gid) == (uid, gid) for p in written), [
        (str(p), p.lstat().st_uid) for p in written if p.lstat().st_uid != uid
    ][:5]


def test_a_wheelhouse_missing_a_wheel_stops_the_build_naming_it(cpu_image, tmp_path) -> None:
    """The real cpu target, built offline from a wheelhouse that lacks one locked wheel.

    The build context is a copy of the project whose requirements-cpu.lock holds three of the real lock's
    entries (so the context stays a few MB and nothing of the repository, its wheelhouse/ or the image's
    build cache changes); its wheelhouse has two of them. The build must stop before pip, naming the third.
    """
    context = project_context(tmp_path / "context")
    lock_text = (ROOT / "requirements-cpu.lock").read_text()
    entries = {m.group(1): m.group(0) for m in re.finditer(r"(?ms)^(idna|mdurl|rich)==(\S+) \\\n.*?(?=^\S)", lock_text)}
    assert set(entries) == {"idna", "mdurl", "rich"}, sorted(entries)
    (context / "requirements-cpu.lock").write_text("".join(entries[n] for n in ("idna", "mdurl", "rich")))
    broken = context / "wheelhouse" / "broken"
    broken.mkdir(parents=True)
    for name in ("idna", "mdurl"):
        for wheel in (ROOT / "wheelhouse" / "cpu").glob(f"{name}-*.whl"):
            shutil.copy2(wheel, broken / wheel.name)
    pin = re.match(r"rich==\S+", entries["rich"]).group(0)
    build = [
        docker_cli(),
        "build",
        "--progress=plain",
        "--target",
        "cpu",
        "-t",
        "deltanet-launcher:broken",
        "--build-arg",
        f"CPU_BASE_IMAGE={BASE_IMAGE}",
        "--build-arg",
        "WHEELHOUSE=broken",
        str(context),
    ]
    out = subprocess.run(build, capture_output=True, text=True, timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    assert out.returncode != 0
    messages = [ln for ln in (out.stdout + out.stderr).splitlines() if "wheelhouse: /wheelhouse/broken cannot" in ln]
    assert len(messages) == 1 and messages[0].endswith(
        f"cannot install requirements-cpu.lock on this platform (x86_64): {pin}: no wheel. Make it on a "
        "connected machine with: python3 docker/wheelhouse.py download requirements-cpu.lock wheelhouse/<name> "
        "--platform <aarch64|x86_64>"
    ), messages or out.stderr[-3000:]


def test_clear_messages_when_the_engine_or_the_image_is_missing(compose: Compose) -> None:
    gone = compose.cmd("up", "train-cpu", env={"DOCKER_HOST": f"unix://{compose.root}/no-engine.sock"}, timeout=60)
    assert gone.returncode != 0 and "Cannot connect to the Docker daemon" in gone.stderr, gone.stderr
    absent = compose.cmd(
        "up",
        "--no-build",
        "--pull",
        "never",
        "train-cpu",
        env={"LAUNCHER_CPU_IMAGE": "deltanet-launcher:absent"},
        timeout=120,
    )
    assert absent.returncode != 0 and "No such image: deltanet-launcher:absent" in absent.stderr, absent.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_containers_train_the_demo_as_two_nodes(cpu_image, engine, tmp_path) -> None:
    """Node 0 and node 1 in two containers on host networking, rendezvous on 127.0.0.1."""
    port = _free_port()
    nodes = [Compose(tmp_path / f"node{rank}") for rank in (0, 1)]
    overlay = ["-f", "compose.yaml", "-f", "tests/support/files/compose.host-network.yaml"]
    names = [f"deltanet-test-node{rank}" for rank in (0, 1)]
    try:
        for rank, node in enumerate(nodes):
            env = {"NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            args = [*overlay, "run", "--detach", "--name", names[rank]]
            for key, value in env.items():
                args += ["-e", f"{key}={value}"]
            node.cmd(*args, "train-cpu", check=True)
        for name in names:
            wait_for(f"{name} to exit", lambda n=name: engine.containers.get(n).status == "exited", timeout=900)
        codes = [engine.containers.get(n).attrs["State"]["ExitCode"] for n in names]
        logs = [engine.containers.get(n).logs(tail=40).decode(errors="replace") for n in names]
        assert codes == [0, 0], "\n---\n".join(logs)
        (run0,) = nodes[0].runs()
        status = nodes[0].status(run0)
        assert status["state"] == "SUCCEEDED", status
        assert (run0 / "output" / "adapter_model.safetensors").is_file()
        (run1,) = nodes[1].runs()
        for rank, (node, run) in enumerate(((nodes[0], run0), (nodes[1], run1))):
            command = node.status(run)["command"]
            assert command[command.index("--nnodes") + 1] == "2", command
            assert command[command.index("--node-rank") + 1] == str(rank), command
            assert command[command.index("--master-addr") + 1] == "127.0.0.1", command
        assert nodes[1].status(run1)["state"] == "SUCCEEDED"
        assert not (run1 / "output" / "adapter_model.safetensors").exists()  # node 0 (world rank 0) saves
    finally:
        for name in names:
            subprocess.run([docker_cli(), "rm", "--force", name], capture_output=True, check=False)
        subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(tmp_path)], check=False)


# one process that takes GPU-0's lease (a device of this test's naming) and holds it; in the container it reads the
# lease folder compose mounts, on the host the one LAUNCHER_LEASE_DIR names (the same folder)
LEASE_HOLDER = """
import sys, time
from pathlib import Path
from launcher.errors import LauncherError
from launcher.state.devices import Device
from launcher.state.lease import DeviceLease, lease_dir
root, run, hold = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "hold"
try:
    lease = DeviceLease([Device("cuda", "0", "cuda:GPU-lease-test")], lease_dir()).acquire(root)
except LauncherError as err:
    print(err, flush=True)
    sys.exit(err.exit_code)
lease.describe(run, root / run, root)
print("held", flush=True)
while hold:
    time.sleep(1)
"""


def lease_on_host(tmp_path: Path, env: dict[str, str], how: str, **popen: Any) -> Any:
    """LEASE_HOLDER on the host: ``hold`` (a running process) or ``once`` (run to its end)."""
    argv = [sys.executable, "-c", LEASE_HOLDER, str(tmp_path / "host-runs"), "host-run", how]
    if how == "hold":
        return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
    return subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_a_host_run_and_a_container_run_see_each_others_leases(compose: Compose, tmp_path) -> None:
    """The lease folder is one host folder, mounted by compose into every container: a lease the host holds refuses
    the container, and one the container holds refuses the host, each naming the holder (the engine is real; the
    device is a name, no GPU is needed to lease it)."""
    folder = tmp_path / "leases"
    env = {"LAUNCHER_LEASE_DIR": str(folder)}
    host = lease_on_host(tmp_path, env, "hold")
    try:
        assert host.stdout.readline() == "held\n"
        seen = compose.cmd(
            "run", "--rm", "train-cpu", "python", "-c", LEASE_HOLDER, "/outputs/runs", "box-run", "once", env=env
        )
        assert seen.returncode == ExitCode.REFUSED, seen.stdout + seen.stderr
        assert "is leased by run host-run of user root" in seen.stdout, seen.stdout
        assert f"runs folder {tmp_path / 'host-runs'}" in seen.stdout, seen.stdout
    finally:
        host.kill()
        host.wait()
    holder = ["run", "-d", "--name", "lease-holder-box", "train-cpu", "python", "-c", LEASE_HOLDER]
    compose.cmd(*holder, "/outputs/runs", "box-run", "hold", env=env, check=True)

    def box_holds() -> bool:
        return "box-run" in "".join(p.read_text() for p in folder.glob("*.owner-*.json"))

    try:
        wait_for("the container's lease", box_holds, timeout=180)
        from_host = launcher_on_host("list", "--devices", env=env)
        assert "box-run" in from_host.stdout and "/outputs/runs" in from_host.stdout, from_host.stdout
        taken = lease_on_host(tmp_path, env, "once")
        assert taken.returncode == ExitCode.REFUSED and "is leased by run box-run" in taken.stdout, taken.stdout
    finally:
        subprocess.run([docker_cli(), "rm", "--force", "lease-holder-box"], capture_output=True, timeout=120)
    freed = lease_on_host(tmp_path, env, "once")
    assert freed.returncode == 0 and freed.stdout == "held\n", freed.stdout  # the container gone: its lease with it


def _checkout(folder: Path) -> Path:
    """A checkout as compose sees one: a folder holding compose.yaml and the configs it mounts (no build context: its
    image is tagged, not built)."""
    folder.mkdir(parents=True)
    shutil.copy2(ROOT / "compose.yaml", folder / "compose.yaml")
    shutil.copytree(ROOT / "configs", folder / "configs")
    return folder


def test_two_checkouts_up_side_by_side_each_reaching_its_own_container(cpu_image, engine, tmp_path) -> None:
    """Two checkouts of the project on one engine (two folders, as two clones or two users' clones), each with its
    own OUTPUTS_DIR, `up -d` side by side: compose names each project, container and image after its folder, so
    the second `up` neither recreates nor retags the first one's. Right after each `up -d` returns, the host's
    `status --root` shows that checkout's new run (it waits for the container the engine shows starting), never the
    previous run; each run SUCCEEDS in its own container. While the longer run still trains, the host's `status`
    and `stop` of the first checkout reach the first checkout's container only; the second is untouched.

    On CPU there are no devices to lease, so the two runs share nothing; that two runs never take the same device
    is tested by tests/run/test_device_lease.py and ``test_a_host_run_and_a_container_run_see_each_others_leases``.
    """
    started = time.monotonic()
    tag = f"{os.getpid()}-{tmp_path.name[-1]}"
    checkouts = [_checkout(tmp_path / f"checkout-{tag}-{n}") for n in ("a", "b")]
    boxes = [Compose(tmp_path / f"host-{n}", checkout) for n, checkout in zip("ab", checkouts, strict=True)]
    names = [compose_names(c.checkout, c.env) for c in boxes]
    assert len({n[0] for n in names}) == len({n[1] for n in names}) == len({n[2] for n in names}) == 2, names
    image = engine.images.get(cpu_image)
    for _, _, own in names:  # each checkout's own tag, as its build would make it
        image.tag(*own.rsplit(":", 1))
    first, second = boxes
    previous = fake_runs.write_record(  # the first checkout's earlier run: never shown once the new one starts
        first.outputs / "runs" / "demo-cpu-20261207-000000", "demo-cpu-20261207-000000", state="SUCCEEDED", exit_code=0
    )
    short = "max_steps=2 save_steps=2 eval_steps=2"
    long = "max_steps=100 save_steps=100 eval_steps=100"

    def status(c: Compose, *more: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "launcher", "status", "--root", str(c.outputs / "runs"), "--json", *more]
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    try:
        shown = []
        for c, overrides in ((first, short), (second, long)):
            c.cmd(
                "up",
                "--detach",
                "--no-build",
                "--pull",
                "never",
                "train-cpu",
                env={"TRAIN_OVERRIDES": overrides},
                check=True,
            )
            shown.append(status(c))  # at once: before the container's launcher holds the lock
        containers = [engine.containers.get(n[1]) for n in names]
        for c, asked, box in zip(boxes, shown, containers, strict=True):
            out, err = asked.communicate(timeout=600)
            assert asked.returncode == 0, out + err
            (run,) = [p for p in c.runs() if p != previous]
            info = json.loads(out)
            assert info["run_id"] == run.name and info["container"]["id"] == box.id, (info, err)
            assert err.startswith(f"waiting for the run being set up under {c.outputs / 'runs'}"), err
        runs = [next(p for p in c.runs() if p != previous) for c in boxes]
        wait_for("the short run to succeed", lambda: first.status(runs[0]).get("state") == "SUCCEEDED", timeout=600)
        wait_for(
            "its container to exit", lambda: engine.containers.get(containers[0].id).status == "exited", timeout=300
        )
        assert second.status(runs[1]).get("state") in ("PENDING", "RUNNING"), second.status(runs[1])
        # the first checkout's host verbs: its own container (exited), never the second's (running)
        stopped = launcher_on_host("stop", "--root", first.outputs / "runs", timeout=300)
        said = stopped.stdout + stopped.stderr
        assert stopped.returncode == 0 and f"run {runs[0].name} already ended: SUCCEEDED" in said, said
        mine = json.loads(launcher_on_host("status", "--root", first.outputs / "runs", "--json").stdout)
        assert mine["container_name"] == names[0][1] and mine["container_status"] == "Exited (0)", mine
        theirs = json.loads(launcher_on_host("status", "--root", second.outputs / "runs", "--json").stdout)
        assert theirs["container_name"] == names[1][1] and theirs["container_state"] == "running", theirs
        for box in containers:
            box.reload()
        assert [b.status for b in containers] == ["exited", "running"]
        wait_for("the long run to succeed", lambda: second.status(runs[1]).get("state") == "SUCCEEDED", timeout=900)
        for c, run, (_, name, own), box in zip(boxes, runs, names, containers, strict=True):
            status_ = c.status(run)
            assert status_["container"] == {**status_["container"], "name": name, "id": box.id}, status_
            manifest = json.loads((run / "manifest.json").read_text())
            assert manifest["image"]["tag"] == own, manifest["image"]  # the project's own tag, the same image
            assert engine.containers.get(box.id).attrs["Image"] == image.id
        assert first.status(previous)["state"] == "SUCCEEDED"
        print(f"\n[containers] two checkouts side by side in {time.monotonic() - started:.0f}s")
    finally:
        for c in boxes:
            c.cmd("down", "--timeout", "30", "--remove-orphans")
        for _, _, own in names:
            subprocess.run([docker_cli(), "rmi", own], capture_output=True, check=False)  # the tag; the image stays
        subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(tmp_path)], check=False)
