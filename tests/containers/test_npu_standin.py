"""The npu and npu-cann9 targets built on stand-ins for the CANN base images, offline from x86_64 wheelhouses.

On demand (marker ``docker_npu``): ``LAUNCHER_DOCKER_TESTS=1 LAUNCHER_DOCKER_NPU_TESTS=1``. It downloads
about 3 GB of wheels per target once and builds for several minutes (docs/containers.md has the measured time).
The stand-in (tests/support/files/cann-standin.Dockerfile) has Python where the CANN image has it (3.11 from a
local Debian bookworm image for CANN 8.5.0; 3.12 from a local Ubuntu noble image for CANN 9.0.0) and stub
``set_env.sh`` files where CANN has them, and no CANN libraries, so this shows that the locked install,
``verify_image`` and the entrypoint work, not that torch_npu runs (that needs a real CANN image). The npu-cann9
build takes a stand-in triton-ascend 3.6.0 wheel (tests/support/standin_wheel.py: the real one is on Huawei's
index only), so it shows the sha256 pin is enforced, not that triton-ascend works.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time

import pytest

from tests.support.engine import BASE_IMAGE, ENABLE, ROOT, docker_cli, project_context
from tests.support.standin_wheel import make_wheel

STANDIN = "local/cann-standin:8.5.0-py3.11"
IMAGE = "deltanet-launcher:npu-standin"
NOBLE = "local/ubuntu-python:noble"
UBUNTU_MIRROR = os.environ.get("UBUNTU_MIRROR", "http://archive.ubuntu.com/ubuntu")
# Debian's ubuntu-keyring package, as the Ubuntu archive serves it: debootstrap checks noble's Release with it
UBUNTU_KEYRING_DEB = "pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb"
STANDIN9 = "local/cann-standin:9.0.0-py3.12"
IMAGE9 = "deltanet-launcher:npu-cann9-standin"
SET_ENV = [
    "/usr/local/Ascend/ascend-toolkit/set_env.sh",
    "/usr/local/Ascend/cann-8.5.0/share/info/ascendnpu-ir/bin/set_env.sh",
    "/usr/local/Ascend/nnal/atb/set_env.sh",
]

pytestmark = [
    pytest.mark.docker_npu,
    pytest.mark.skipif(
        os.environ.get(ENABLE) != "1" or os.environ.get("LAUNCHER_DOCKER_NPU_TESTS") != "1",
        reason=f"on demand: set {ENABLE}=1 and LAUNCHER_DOCKER_NPU_TESTS=1 with a Docker engine running "
        "(downloads ~3 GB of wheels, builds the npu target for several minutes)",
    ),
]


def _docker(args: list[str], timeout: int = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [docker_cli(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "DOCKER_BUILDKIT": "1"},
    )


def _wheelhouse_context(tmp_path_factory, lock: str, python: str, name: str) -> os.PathLike:
    """A build context (the project's files) with an x86_64 wheelhouse for ``lock`` at wheelhouse/<name>; the wheels
    are kept in build/ (ignored by git), so the repository's wheelhouse/ -- and the cpu image's cache -- stay."""
    cache = ROOT / "build" / f"wheelhouse-{name}-x86_64"
    download = [
        sys.executable,
        "docker/wheelhouse.py",
        "download",
        lock,
        str(cache),
        "--platform",
        "x86_64",
        "--python",
        python,
    ]
    out = subprocess.run(download, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    context = project_context(tmp_path_factory.mktemp(f"{name}-context"))
    (context / "wheelhouse" / name).mkdir(parents=True)
    for wheel in cache.glob("*.whl"):
        os.link(wheel, context / "wheelhouse" / name / wheel.name)
    return context


def _prune_contexts() -> None:
    # BuildKit keeps a copy of every local build context it was sent; these hold 3 GB of wheels.
    subprocess.run(
        [docker_cli(), "builder", "prune", "--force", "--filter", "type=source.local"], capture_output=True, check=False
    )


@pytest.fixture(scope="module")
def npu_image(engine, tmp_path_factory) -> dict[str, object]:
    t0 = time.monotonic()
    subprocess.run(["bash", "scripts/docker-base-image.sh", BASE_IMAGE], cwd=ROOT, check=True, timeout=900)
    files = "tests/support/files"
    out = _docker(["build", "-f", f"{files}/cann-standin.Dockerfile", "-t", STANDIN, str(ROOT / files)], 600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    t1 = time.monotonic()
    context = _wheelhouse_context(tmp_path_factory, "requirements.lock", "3.11.14", "npu-x86_64")
    t2 = time.monotonic()
    out = _docker(
        [
            "build",
            "--progress=plain",
            "--target",
            "npu",
            "--build-arg",
            f"CANN_IMAGE={STANDIN}",
            "--build-arg",
            "WHEELHOUSE=npu-x86_64",
            "-t",
            IMAGE,
            str(context),
        ]
    )
    t3 = time.monotonic()
    _prune_contexts()
    timings = {"base+standin_s": t1 - t0, "wheelhouse_s": t2 - t1, "npu_build_s": t3 - t2}
    print(f"\n[npu stand-in] {', '.join(f'{k} {v:.0f}' for k, v in timings.items())}")
    return {"build": out, "timings": timings}


def _noble_base(tmp_path) -> None:
    """Ubuntu 24.04 with its Python 3.12 (scripts/docker-base-image.sh), checked with the Ubuntu archive's keyring."""
    deb = tmp_path / "ubuntu-keyring.deb"
    subprocess.run(["curl", "-fsS", "-o", str(deb), f"{UBUNTU_MIRROR}/{UBUNTU_KEYRING_DEB}"], check=True, timeout=300)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path / "keyring")], check=True, timeout=60)
    env = {
        **os.environ,
        "DEBIAN_SUITE": "noble",
        "DEBIAN_MIRROR": UBUNTU_MIRROR,
        "BASE_PYTHON": "python3.12",
        "DEBOOTSTRAP_COMPONENTS": "main,universe",
        "DEBOOTSTRAP_KEYRING": str(tmp_path / "keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg"),
    }
    subprocess.run(["bash", "scripts/docker-base-image.sh", NOBLE], cwd=ROOT, check=True, timeout=1800, env=env)


@pytest.fixture(scope="module")
def cann9_image(engine, tmp_path_factory) -> dict[str, object]:
    """The npu-cann9 target built three times on the same context: with no pin, with a wrong pin (both refused at
    the pinned wheel's step, after the cached lock install), then with the stand-in wheel's own sha256."""
    t0 = time.monotonic()
    _noble_base(tmp_path_factory.mktemp("noble"))
    files = "tests/support/files"
    out = _docker(
        [
            "build",
            "-f",
            f"{files}/cann-standin.Dockerfile",
            "--build-arg",
            f"STANDIN_BASE={NOBLE}",
            "--build-arg",
            "PYTHON=python3.12",
            "--build-arg",
            "PYTHON_HOME=/usr/local/python3.12.13",
            "--build-arg",
            "CANN_VERSION=9.0.0",
            "-t",
            STANDIN9,
            str(ROOT / files),
        ],
        600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    t1 = time.monotonic()
    context = _wheelhouse_context(tmp_path_factory, "requirements-npu-cann9.lock", "3.12.13", "npu-cann9")
    # bytes of this session's own (another sha256), so the pinned step never comes from an earlier build's cache
    wheel = make_wheel(context / "wheelhouse" / "npu-cann9", note=f"stand-in {time.time_ns()}")
    pin = hashlib.sha256(wheel.read_bytes()).hexdigest()
    t2 = time.monotonic()

    def build(sha: str, *extra: str) -> subprocess.CompletedProcess:
        return _docker(
            [
                "build",
                "--progress=plain",
                "--target",
                "npu-cann9",
                "--build-arg",
                f"CANN9_IMAGE={STANDIN9}",
                "--build-arg",
                "WHEELHOUSE=npu-cann9",
                "--build-arg",
                f"TRITON_ASCEND_SHA256={sha}",
                *extra,
                "-t",
                IMAGE9,
                str(context),
            ]
        )

    wrong = build("0" * 64)  # the locked install runs here (or comes from an earlier session's cache)
    empty = build("")
    t3 = time.monotonic()
    good = build(pin)
    t4 = time.monotonic()
    _prune_contexts()
    timings = {
        "base+standin_s": t1 - t0,
        "wheelhouse_s": t2 - t1,
        "refused_builds_s": t3 - t2,
        "cann9_build_s": t4 - t3,
    }
    print(f"\n[npu-cann9 stand-in] {', '.join(f'{k} {v:.0f}' for k, v in timings.items())}")
    return {"build": good, "wrong": wrong, "empty": empty, "pin": pin, "wheel": wheel.name}


def test_locked_install_and_verify_image_pass_on_the_standin(npu_image) -> None:
    out = npu_image["build"]
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "wheelhouse: /wheelhouse/npu-x86_64 has every wheel requirements.lock needs on this platform" in log
    assert "--no-index --find-links /wheelhouse/npu-x86_64" in log
    assert "verify_image.py" in log and "verify_image:" not in log  # the guard ran and reported nothing


def test_image_has_the_locked_npu_stack_and_no_community_triton(npu_image, engine) -> None:  # noqa: F811
    script = (
        "from importlib import metadata as m\n"
        "for name in ('torch', 'torch-npu', 'triton-ascend', 'fla-core', 'llamafactory'):\n"
        "    print(name, m.version(name))\n"
        "try:\n"
        "    m.version('triton'); print('COMMUNITY TRITON')\n"
        "except m.PackageNotFoundError:\n"
        "    pass\n"
        "import sys; print('python', sys.version.split()[0], sys.base_prefix)\n"
    )
    text = engine.containers.run(IMAGE, ["python", "-c", script], remove=True).decode()
    assert "torch 2.7.1" in text and "torch-npu 2.7.1.post2" in text and "triton-ascend 3.2.0" in text, text
    assert "fla-core 0.6.0" in text and "llamafactory 0.9.5" in text, text
    assert "COMMUNITY TRITON" not in text
    venv = engine.containers.run(IMAGE, ["cat", "/opt/venv/pyvenv.cfg"], remove=True).decode()
    assert "/usr/local/python3.11.14/bin" in venv  # the venv was made from the CANN-path Python


def test_entrypoint_sources_the_cann_environment_for_the_main_process(npu_image, engine) -> None:  # noqa: F811
    command = ["bash", "-c", 'echo "sourced=$CANN_STANDIN_SOURCED"; echo "home=$ASCEND_HOME_PATH"']
    container = engine.containers.run(IMAGE, command, detach=True, init=True)
    try:
        assert container.wait(timeout=120)["StatusCode"] == 0
        stdout = container.logs(stdout=True, stderr=False).decode()
        stderr = container.logs(stdout=False, stderr=True).decode()
    finally:
        container.remove(force=True)
    assert f"sourced={':'.join(SET_ENV)}" in stdout, stdout
    assert "home=/usr/local/Ascend/ascend-toolkit/latest" in stdout
    assert "not found" not in stderr, stderr  # every CANN file the entrypoint looks for exists


def test_cann9_build_refuses_a_triton_ascend_wheel_it_was_not_pinned_for(cann9_image) -> None:
    wrong, empty = cann9_image["wrong"], cann9_image["empty"]
    assert wrong.returncode != 0 and empty.returncode != 0
    wrong_log, empty_log = wrong.stdout + wrong.stderr, empty.stdout + empty.stderr
    assert f"{cann9_image['wheel']} has sha256 {cann9_image['pin']}, but the pinned value is {'0' * 64}" in wrong_log
    assert "no sha256 is pinned for it" in empty_log and cann9_image["pin"] in empty_log
    # the lock itself installed offline before the refusal (now, or in a cached layer): only the pinned step failed
    ran = "wheelhouse: /wheelhouse/npu-cann9 has every wheel requirements-npu-cann9.lock needs on this" in wrong_log
    step = re.search(r"^(#\d+) \[[^]]*\] RUN .*wheelhouse\.py install requirements-npu-cann9\.lock$", wrong_log, re.M)
    assert step is not None and (ran or f"{step.group(1)} CACHED" in wrong_log), wrong_log[-3000:]


def test_cann9_locked_install_pinned_wheel_and_verify_image_pass_on_the_standin(cann9_image) -> None:
    out = cann9_image["build"]
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert f"sha256 {cann9_image['pin']} matches the pinned value" in log
    assert "verify_image.py" in log and "verify_image:" not in log


def test_cann9_image_has_the_declared_pairing_and_records_the_pin(cann9_image, engine) -> None:
    script = (
        "import json, sys\n"
        "from importlib import metadata as m\n"
        "names = ('torch', 'torch-npu', 'triton-ascend', 'fla-core', 'llamafactory', 'torchvision', 'triton')\n"
        "found = {}\n"
        "for name in names:\n"
        "    try:\n"
        "        found[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        found[name] = None\n"
        "from launcher.checks.packages import lock_path\n"
        "from launcher.run.rundir import image_record\n"
        "print(json.dumps({'versions': found, 'python': sys.version.split()[0], 'prefix': sys.base_prefix,\n"
        "                  'lock': lock_path('npu').name, 'image': image_record()}))\n"
    )
    import json

    facts = json.loads(engine.containers.run(IMAGE9, ["python", "-c", script], remove=True).decode().splitlines()[-1])
    assert facts["versions"] == {
        "torch": "2.10.0",
        "torch-npu": "2.10.0.post7",
        "triton-ascend": "3.6.0",
        "fla-core": "0.6.0",
        "llamafactory": "0.9.5",
        "torchvision": "0.25.0",
        "triton": None,
    }, facts
    assert facts["python"].startswith("3.12.") and facts["prefix"] == "/usr"  # the venv of the CANN-path Python
    assert facts["lock"] == "requirements-npu-cann9.lock"  # preflight's packages row compares against it
    assert facts["image"]["triton_ascend_sha256"] == cann9_image["pin"]  # what every run's manifest.json records
    venv = engine.containers.run(IMAGE9, ["cat", "/opt/venv/pyvenv.cfg"], remove=True).decode()
    assert "/usr/local/python3.12.13/bin" in venv
    cann = engine.containers.run(IMAGE9, ["bash", "-c", 'echo "$CANN_STANDIN_SOURCED"'], remove=True).decode()
    assert "/usr/local/Ascend/cann-9.0.0/share/info/ascendnpu-ir/bin/set_env.sh" in cann
