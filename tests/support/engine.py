"""The real Docker engine's session fixtures, shared by tests/containers and tests/slurm.

``LAUNCHER_DOCKER_TESTS=1`` (``.ci/run`` installs and starts an engine and sets it) switches the
real-engine tests on; then an engine that does not answer is a failure, never a skip. ``cpu_image`` is
built once per session with no registry, as the README says, under the name compose gives it in this checkout
(``deltanet-launcher:<project>-cpu``, the project named after the checkout's folder: ``compose_names``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENABLE = "LAUNCHER_DOCKER_TESTS"
BASE_IMAGE = "local/debian-python:bookworm"


def docker_cli() -> str:
    """Debian's client (it has BuildKit and finds the compose v2 plugin); any `docker` otherwise."""
    return "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else (shutil.which("docker") or "docker")


def compose_config(folder: Path = ROOT, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``docker compose --profile cpu config`` of the compose file in ``folder``, as compose resolves it there
    (``env``: the environment; the process's own by default)."""
    out = subprocess.run(
        [docker_cli(), "compose", "--profile", "cpu", "config", "--format", "json"],
        cwd=folder,
        env=os.environ if env is None else env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout)


def compose_names(folder: Path = ROOT, env: dict[str, str] | None = None) -> tuple[str, str, str]:
    """The compose project, train-cpu's container and its image, as compose names them in ``folder``."""
    config = compose_config(folder, env)
    cpu = config["services"]["train-cpu"]
    return config["name"], cpu["environment"]["LAUNCHER_CONTAINER"], cpu["image"]


@cache
def cpu_image_name() -> str:
    """The cpu image this checkout's compose builds and runs (LAUNCHER_CPU_IMAGE of the environment, if set)."""
    return compose_names()[2]


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def project_context(dest: Path) -> Path:
    """A build context of its own: the project's files (tracked and new, as git sees them), no wheels."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file() and not name.startswith("wheelhouse/"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / "wheelhouse").mkdir(exist_ok=True)
    return dest


# --- session: engine, base image, wheelhouse, image ---------------------------------------------------


@pytest.fixture(scope="session")
def engine():
    """The docker SDK client of a live engine; a failure (never a skip) when none answers."""
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except DockerException as e:
        pytest.fail(f"{ENABLE}=1 but no Docker engine answers ({e}); start one: bash scripts/docker-engine.sh start")
    yield client
    client.close()


@pytest.fixture(scope="session")
def cpu_image(engine) -> str:
    """The cpu image, built once per session with no registry, as the README says: the cpu wheelhouse made
    here (docker/wheelhouse.py download), then ``scripts/build-image.sh cpu`` (the wheelhouse checked for the
    image's platform, the local base image, the offline build)."""
    started = time.monotonic()
    wheelhouse = ROOT / "wheelhouse" / "cpu"
    made_here = not wheelhouse.exists()
    download = [sys.executable, "docker/wheelhouse.py", "download", "requirements-cpu.lock", str(wheelhouse)]
    done = False
    try:
        out = subprocess.run(download, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        done = out.returncode == 0
    finally:
        if made_here and not done:  # a partial download (a full disk, a timeout): the disk back
            shutil.rmtree(wheelhouse, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    env = {
        **os.environ,
        "PATH": f"{Path(docker_cli()).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,
        "LAUNCHER_GIT_COMMIT": git_commit(),
    }
    for name in ("CPU_BASE_IMAGE", "WHEELHOUSE", "REGISTRY_MIRROR"):
        env.pop(name, None)
    out = subprocess.run(
        ["bash", "scripts/build-image.sh", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    # BuildKit keeps a copy of each build context (~3 GB here): give that disk back, the layers stay
    subprocess.run(
        [docker_cli(), "builder", "prune", "--force", "--filter", "type=source.local"],
        capture_output=True,
        timeout=300,
        check=False,
    )
    print(f"\n[containers] base + wheelhouse + cpu image ready in {time.monotonic() - started:.0f}s")
    return cpu_image_name()
