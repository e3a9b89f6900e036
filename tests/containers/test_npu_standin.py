"""The npu target built on a stand-in for the CANN base image, offline from an x86_64 wheelhouse.

On demand (marker ``docker_npu``): ``LAUNCHER_DOCKER_TESTS=1 LAUNCHER_DOCKER_NPU_TESTS=1``. It downloads
about 3 GB of wheels once and builds for several minutes (docs/containers.md has the measured time).
The stand-in (tests/support/files/cann-standin.Dockerfile) has Python 3.11 where the CANN image has it and stub
``set_env.sh`` files where CANN has them, and no CANN libraries, so this shows that the locked install,
``verify_image`` and the entrypoint work, not that torch_npu runs (that needs a real CANN image).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.engine import BASE_IMAGE, ENABLE, ROOT, docker_cli, project_context

STANDIN = "local/cann-standin:8.5.0-py3.11"
IMAGE = "deltanet-launcher:npu-standin"
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


@pytest.fixture(scope="module")
def npu_image(engine, tmp_path_factory) -> dict[str, object]:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    subprocess.run(["bash", "scripts/docker-base-image.sh", BASE_IMAGE], cwd=ROOT, check=True, timeout=900)
    files = "tests/support/files"
    standin = [docker_cli(), "build", "-f", f"{files}/cann-standin.Dockerfile", "-t", STANDIN, files]
    out = subprocess.run(standin, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DOCKER_BUILDKIT": "1"})  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    t1 = time.monotonic()
    # The wheels are kept in build/ (ignored by git) and the image is built from a context of its own
    # (the project's files plus that wheelhouse), so the repository's wheelhouse/ -- and with it the
    # build cache of the cpu image, whose install step mounts wheelhouse/ -- stays as it is.
    cache = ROOT / "build" / "wheelhouse-npu-x86_64"
    download = [sys.executable, "docker/wheelhouse.py", "download", "requirements.lock", str(cache),
                "--platform", "x86_64"]  # fmt: skip
    out = subprocess.run(download, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    context = project_context(tmp_path_factory.mktemp("npu-context"))
    (context / "wheelhouse" / "npu-x86_64").mkdir(parents=True)
    for wheel in cache.glob("*.whl"):
        os.link(wheel, context / "wheelhouse" / "npu-x86_64" / wheel.name)
    t2 = time.monotonic()
    build = [docker_cli(), "build", "--progress=plain", "--target", "npu", "--build-arg", f"CANN_IMAGE={STANDIN}",
             "--build-arg", "WHEELHOUSE=npu-x86_64", "-t", IMAGE, str(context)]  # fmt: skip
    out = subprocess.run(build, capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "DOCKER_BUILDKIT": "1"})  # fmt: skip
    t3 = time.monotonic()
    # BuildKit keeps a copy of every local build context it was sent; this one holds 3 GB of wheels.
    subprocess.run([docker_cli(), "builder", "prune", "--force", "--filter", "type=source.local"],
                   capture_output=True, check=False)  # fmt: skip
    timings = {"base+standin_s": t1 - t0, "wheelhouse_s": t2 - t1, "npu_build_s": t3 - t2}
    print(f"\n[npu stand-in] {', '.join(f'{k} {v:.0f}' for k, v in timings.items())}")
    return {"build": out, "timings": timings}


def test_locked_install_and_verify_image_pass_on_the_standin(npu_image) -> None:
    out = npu_image["build"]
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "wheelhouse: /wheelhouse/npu-x86_64 has every wheel requirements.lock needs here" in log
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
