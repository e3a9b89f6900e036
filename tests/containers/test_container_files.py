"""The container files without an engine: the cpu target, compose's train-cpu, docker/wheelhouse.py, the docs.

tests/containers/test_containers.py runs all of this for real against a Docker engine; these checks run everywhere
and name the file and line that drifted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
LOCKS = {"cuda": "requirements-cuda.lock", "cpu": "requirements-cpu.lock", "npu": "requirements.lock"}


def _wheelhouse_module():
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "docker" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["wheelhouse"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _stages() -> dict[str, list[str]]:
    """Instructions (joined continuation lines, comments dropped) per stage."""
    stages: dict[str, list[str]] = {}
    current, logical = None, ""
    for raw in DOCKERFILE.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        logical += " " + line.rstrip("\\").strip()
        if line.endswith("\\"):
            continue
        instruction, logical = logical.strip(), ""
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", instruction, re.IGNORECASE):
            current = m.group(1)
            stages[current] = []
        if current:
            stages[current].append(instruction)
    return stages


# --- Dockerfile ---------------------------------------------------------------------------------------


def test_four_targets_npu_last_and_no_frontend_to_pull() -> None:
    assert list(_stages()) == ["cuda", "cpu", "npu-cann9", "npu"]  # the last stage is what `docker build .` builds
    assert not DOCKERFILE.startswith("# syntax=")
    mirror = re.escape("${REGISTRY_MIRROR:+${REGISTRY_MIRROR}/}")
    assert re.search(rf"^ARG CPU_BASE_IMAGE={mirror}docker\.io/library/python:3\.11\.\d+-bookworm$", DOCKERFILE, re.M)
    # every base image is pulled through the registry mirror when REGISTRY_MIRROR is given (compose passes it)
    bases = re.findall(r"^ARG (\w+_IMAGE)=(.*)$", DOCKERFILE, re.M)
    assert {name for name, _ in bases} == {"CANN_IMAGE", "CANN9_IMAGE", "CUDA_BASE_IMAGE", "CPU_BASE_IMAGE"}
    assert all(re.match(mirror + r"(docker|quay)\.io/", value) for _, value in bases), bases
    for service in ("train", "train-cann9", "train-cuda", "train-cpu"):
        args = COMPOSE["services"][service]["build"]["args"]
        assert "REGISTRY_MIRROR" in (args if isinstance(args, dict) else [a.split("=")[0] for a in args]), service


@pytest.mark.parametrize("target", list(LOCKS))
def test_every_target_installs_its_lock_through_the_wheelhouse_step(target: str) -> None:
    steps = _stages()[target]
    install = [s for s in steps if "wheelhouse.py install" in s]
    mount = "RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse"
    assert install == [f"{mount} python docker/wheelhouse.py install {LOCKS[target]}"]
    assert 'ARG WHEELHOUSE=""' in steps
    other_pip = [s for s in steps if "pip install" in s]
    assert other_pip == ["RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index --editable ."]


def _kinds(steps: list[str]) -> list[str]:
    """The layer order: which of the significant steps come in which order."""
    marks = [
        ("venv", "-m venv /opt/venv"),
        ("lock", "wheelhouse.py install"),
        ("verify", "verify_image.py "),
        ("project", "--editable ."),
        ("configs", "COPY configs/"),
        ("entrypoint", "launcher-entrypoint"),
        ("commit", "LAUNCHER_GIT_COMMIT=${"),
    ]
    return [name for step in steps for name, needle in marks if needle in step]


def test_cpu_target_has_the_npu_and_cuda_layer_order() -> None:
    stages = _stages()
    assert _kinds(stages["cpu"]) == _kinds(stages["npu"]) == _kinds(stages["cuda"])
    # npu-cann9 adds one step to that order: the user's pinned triton-ascend wheel, right after the locked install
    cann9 = _kinds(stages["npu-cann9"])
    first = cann9.index("lock")
    assert cann9[first : first + 2] == ["lock", "lock"] and cann9[:first] + cann9[first + 1 :] == _kinds(stages["npu"])
    pinned = [step for step in stages["npu-cann9"] if "wheelhouse.py install-pinned" in step]
    assert len(pinned) == 1 and "--sha256" in pinned[0]
    entry = [s for s in stages["cpu"] if s.startswith(("ENTRYPOINT", "CMD"))]
    assert entry == ['ENTRYPOINT ["/usr/local/bin/launcher-entrypoint"]', 'CMD ["launcher", "--help"]']


@pytest.mark.parametrize(
    ("target", "base"),
    [("cuda", "CUDA_BASE_IMAGE"), ("cpu", "CPU_BASE_IMAGE"), ("npu", "CANN_IMAGE"), ("npu-cann9", "CANN9_IMAGE")],
)
def test_base_image_is_recorded_from_a_redeclared_arg(target: str, base: str) -> None:
    steps = _stages()[target]
    declared = steps.index(f"ARG {base}")
    env = next(i for i, s in enumerate(steps) if f"LAUNCHER_BASE_IMAGE=${{{base}}}" in s)
    assert declared < env  # a global ARG is empty in a stage unless declared again


def test_cpu_pins_agree_with_the_lock_and_the_dev_environment() -> None:
    from launcher.checks import packages as lockfile

    args = dict(re.findall(r"ARG (\w+)=(\S+)", "\n".join(_stages()["cpu"])))
    lock = {p.name: p.version for p in lockfile.parse_lock(ROOT / "requirements-cpu.lock")}
    assert lock["torch"] == args["TORCH_VERSION"] and lock["torchvision"] == args["TORCHVISION_VERSION"]
    assert lock["torchaudio"] == args["TORCHAUDIO_VERSION"] and lock["llamafactory"] == args["LLAMAFACTORY_VERSION"]
    setup = (ROOT / "scripts" / "setup-env.sh").read_text()
    assert f"torch=={lock['torch']} torchvision=={lock['torchvision']}" in setup
    npu = {p.name: p.version for p in lockfile.parse_lock(ROOT / "requirements.lock")}
    for name in ("llamafactory", "transformers", "peft", "accelerate", "trl", "datasets", "tokenizers"):
        assert lock[name] == npu[name], name
    assert "torch-npu" not in lock and "triton-ascend" not in lock
    header = (ROOT / "requirements-cpu.lock").read_text().splitlines()[1]
    in_text = " ".join((ROOT / "requirements-cpu.in").read_text().replace("\\", " ").replace("#", " ").split())
    assert " ".join(header.lstrip("#").split()) in in_text  # the lock names the documented command


# --- compose.yaml -------------------------------------------------------------------------------------

SHARED = (
    "working_dir",
    "init",
    "stop_signal",
    "stop_grace_period",
    "restart",
    "privileged",
    "security_opt",
    "user",
    "group_add",
)


def test_train_cpu_runs_the_demo_config_with_trains_settings() -> None:
    services = COMPOSE["services"]
    cpu, train = services["train-cpu"], services["train"]
    assert cpu["profiles"] == ["cpu"] and cpu["build"]["target"] == "cpu"
    assert cpu["command"] == ["launcher", "run", "${TRAIN_CONFIG_CPU:-configs/demo_cpu.yaml}"]
    for key in SHARED:
        assert cpu[key] == train[key] == services["train-cuda"][key], key
    assert cpu["volumes"] == services["train-cuda"]["volumes"] == train["volumes"][-len(cpu["volumes"]) :]
    assert cpu["user"] == "${UID:-0}:${GID:-0}" and cpu["group_add"] == ["${DEVICE_GID:-${GID:-0}}"]
    assert "devices" not in cpu and "ulimits" not in cpu and "network_mode" not in cpu


# what each service's image is named after its project, the variant of the Dockerfile it is built from
IMAGE_VARIANTS = {"train": "npu", "train-cann9": "npu-cann9", "train-cuda": "cuda", "train-cpu": "cpu"}


def test_every_service_names_its_container_and_image_after_the_project() -> None:
    """No fixed project, container or image name (two checkouts on one engine would share them): compose names the
    project after the checkout's folder, the container <project>-<service>-1, and the image carries the project."""
    assert "name" not in COMPOSE  # compose derives it: -p, COMPOSE_PROJECT_NAME, else the folder
    for name, svc in COMPOSE["services"].items():
        env = svc["environment"]
        assert "container_name" not in svc, name
        assert env["LAUNCHER_CONTAINER"] == f"${{COMPOSE_PROJECT_NAME}}-{name}-1", name
        assert svc["image"] == env["LAUNCHER_IMAGE"], name
        assert svc["image"].endswith(f":-deltanet-launcher:${{COMPOSE_PROJECT_NAME}}-{IMAGE_VARIANTS[name]}}}"), name
        assert env["HF_HUB_OFFLINE"] == "1" and env["LAUNCHER_WRITABLE_DIRS"] == "/outputs /logs", name
        assert env["TRITON_CACHE_DIR"] == "/outputs/.cache/triton" and env["TRITON_CACHE_AUTOTUNING"] == "1", name


def _compose_names(folder: Path, **env: str) -> tuple[str, str, str]:
    """(project, train-cpu's container, its image) as the installed ``docker compose config`` resolves them in
    ``folder``, with ``env`` over an environment without compose's own settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "LAUNCHER_"))}
    out = subprocess.run(
        [_docker_compose_cli(), "compose", "--profile", "cpu", "config", "--format", "json"],
        cwd=folder,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    config = json.loads(out.stdout)
    cpu = config["services"]["train-cpu"]
    assert cpu["environment"]["LAUNCHER_IMAGE"] == cpu["image"] and "container_name" not in cpu
    return config["name"], cpu["environment"]["LAUNCHER_CONTAINER"], cpu["image"]


def _docker_compose_cli() -> str:
    """A docker CLI with the compose v2 plugin; the test is skipped without one (no engine is needed)."""
    cli = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
    if not cli or subprocess.run([cli, "compose", "version"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("docker compose v2 is not installed here (bash scripts/docker-engine.sh install)")
    return cli


def test_two_checkouts_and_two_users_get_their_own_project_container_and_image(tmp_path) -> None:
    """Two checkouts of compose.yaml (folder names as a user may give them) resolve to projects, containers and
    images of their own; COMPOSE_PROJECT_NAME (a user's .env) separates two checkouts in folders of the same
    name, and overrides of the image keep working."""
    _docker_compose_cli()
    folders = [tmp_path / "alice" / "deltanet-launcher", tmp_path / "bob" / "Launcher.Second_Copy"]
    for folder in folders:
        folder.mkdir(parents=True)
        shutil.copy2(ROOT / "compose.yaml", folder / "compose.yaml")
    first, second = (_compose_names(folder) for folder in folders)
    assert first == ("deltanet-launcher", "deltanet-launcher-train-cpu-1", "deltanet-launcher:deltanet-launcher-cpu")
    # compose lowercases the folder's name and drops what a project name cannot hold
    assert second == (
        "launchersecond_copy",
        "launchersecond_copy-train-cpu-1",
        "deltanet-launcher:launchersecond_copy-cpu",
    )
    # the same folder name for two users: COMPOSE_PROJECT_NAME (shell or .env) parts them
    (folders[0] / ".env").write_text("COMPOSE_PROJECT_NAME=deltanet-alice\n")
    assert _compose_names(folders[0]) == (
        "deltanet-alice",
        "deltanet-alice-train-cpu-1",
        "deltanet-launcher:deltanet-alice-cpu",
    )
    assert _compose_names(folders[1], COMPOSE_PROJECT_NAME="bob")[1:] == (
        "bob-train-cpu-1",
        "deltanet-launcher:bob-cpu",
    )
    assert _compose_names(folders[1], LAUNCHER_CPU_IMAGE="mine:1")[2] == "mine:1"


def test_the_anchors_are_what_the_services_use() -> None:
    text = (ROOT / "compose.yaml").read_text()
    assert text.count("<<: *run-service") == 3 and text.count("<<: *run-environment") == 4
    # train-cann9 is train (devices, driver mounts, shm, ulimits) with its own image, build and environment
    assert text.count("<<: *npu-service") == 1 and "train: &npu-service" in text
    cann9, train = COMPOSE["services"]["train-cann9"], COMPOSE["services"]["train"]
    assert cann9["build"]["target"] == "npu-cann9" and cann9["profiles"] == ["cann9"]
    assert cann9["build"]["args"]["TRITON_ASCEND_SHA256"] == "${TRITON_ASCEND_SHA256:-}"
    same = ("devices", "volumes", "shm_size", "ulimits", "command", "working_dir", "security_opt", "user")
    assert {key: cann9[key] for key in same} == {key: train[key] for key in same}
    assert {k: v for k, v in cann9["environment"].items() if not k.startswith("LAUNCHER_")} == {
        k: v for k, v in train["environment"].items() if not k.startswith("LAUNCHER_")
    }
    for volume in ("model", "data", "outputs", "logs", "configs"):
        assert f"- *{volume}-volume" in text  # train lists the anchored entries, not copies


def test_configs_demo_paths_resolve_inside_the_cpu_image() -> None:
    demo = yaml.safe_load((ROOT / "configs" / "demo_cpu.yaml").read_text())
    assert demo["model_name_or_path"] == "demo/model" and demo["dataset_dir"] == "demo/data"
    assert demo["launcher"]["output_root"] == "outputs/runs"
    cpu = "\n".join(_stages()["cpu"])
    assert "launcher demo-assets --out demo" in cpu and "ln -s /outputs outputs" in cpu
    assert COMPOSE["services"]["train-cpu"]["working_dir"] == "/opt/launcher"


# --- docker/wheelhouse.py -----------------------------------------------------------------------------


def _fake_wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any") -> tuple[Path, str]:
    path = folder / f"{name}-{version}-{tag}.whl"
    path.write_bytes(f"{name} {version}".encode())
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _write_lock(path: Path, *entries: tuple[str, ...]) -> Path:
    """A uv-style lock: each entry's requirement, its hash on a continuation line, then any comment lines."""
    path.write_text(
        "".join(
            f"{req} \\\n    --hash=sha256:{digest}\n" + "".join(f"    {c}\n" for c in comments)
            for req, digest, *comments in entries
        )
    )
    return path


def test_check_names_each_missing_or_mismatched_package(tmp_path: Path) -> None:
    wh = _wheelhouse_module()
    house = tmp_path / "house"
    house.mkdir()
    _, good = _fake_wheel(house, "alpha", "1.0")
    _fake_wheel(house, "beta", "2.0")
    _, _other = _fake_wheel(house, "delta", "4.0", "cp311-cp311-manylinux_2_17_s390x")
    lock = _write_lock(
        tmp_path / "req.lock",
        ("alpha==1.0", good, "# via -r req.in"),
        ("beta==2.0", "0" * 64),
        ("gamma==3.0", "1" * 64),
        ("delta==4.0", "2" * 64),
        ("winonly==5.0 ; sys_platform == 'win32'", "3" * 64),
    )
    problems = wh.check(lock, house)
    assert problems == [
        "beta==2.0: beta-2.0-py3-none-any.whl has a hash the lock does not list",
        "gamma==3.0: no wheel",
        "delta==4.0: only wheels for other platforms (delta-4.0-cp311-cp311-manylinux_2_17_s390x.whl)",
    ]
    out = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "wheelhouse.py"), "check", str(lock), str(house)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and out.stderr.count("\n") == 1  # one message
    assert "gamma==3.0: no wheel" in out.stderr and "wheelhouse.py download" in out.stderr


def test_check_for_the_images_platform_names_what_that_build_would_miss(tmp_path: Path) -> None:
    """`check --platform` judges wheels and markers for the image (linux, CPython 3.11), not for the machine
    it runs on: before a build starts, it names every wheel the image's install step would not find."""
    house = tmp_path / "house"
    house.mkdir()
    _, native = _fake_wheel(house, "alpha", "1.0", "cp311-cp311-manylinux_2_17_x86_64")
    _, pure = _fake_wheel(house, "beta", "2.0")
    _, newer = _fake_wheel(house, "gamma", "3.0", "cp312-cp312-manylinux_2_17_x86_64")
    lock = _write_lock(
        tmp_path / "req.lock",
        ("alpha==1.0", native),
        ("beta==2.0", pure),
        ("gamma==3.0", newer),
        ("armonly==4.0 ; platform_machine == 'aarch64'", "4" * 64),
    )

    def check(machine: str) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            str(ROOT / "docker" / "wheelhouse.py"),
            "check",
            str(lock),
            str(house),
            "--platform",
            machine,
            "--python",
            "3.11.14",
        ]
        return subprocess.run(command, capture_output=True, text=True)

    x86 = check("x86_64")
    assert x86.returncode == 1 and x86.stderr.count("\n") == 1, x86.stderr
    assert x86.stderr.startswith(
        f"wheelhouse: {house} cannot install req.lock on linux x86_64, CPython 3.11.14: "
        "gamma==3.0: only wheels for other platforms (gamma-3.0-cp312-cp312-manylinux_2_17_"
        "x86_64.whl). Make it on a connected machine with: "
    ), x86.stderr
    arm = check("aarch64")
    assert arm.returncode == 1
    for missing in ("alpha==1.0: only wheels for other platforms", "gamma==3.0", "armonly==4.0: no wheel"):
        assert missing in arm.stderr, arm.stderr
    assert "beta" not in arm.stderr  # a pure-Python wheel fits every platform
    (house / "gamma-3.0-cp312-cp312-manylinux_2_17_x86_64.whl").unlink()
    _, fixed = _fake_wheel(house, "gamma", "3.0", "cp311-abi3-manylinux2014_x86_64")
    lock.write_text(lock.read_text().replace(newer, fixed))
    done = check("x86_64")
    assert done.returncode == 0 and "has every wheel req.lock needs on linux x86_64" in done.stdout, done.stderr


def test_download_evaluates_markers_for_the_target_platform(tmp_path: Path, monkeypatch) -> None:
    wh = _wheelhouse_module()
    seen = {}

    def fake_run(command, check):
        seen["command"] = command
        seen["requirements"] = Path(command[command.index("-r") + 1]).read_text()
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(wh.subprocess, "run", fake_run)
    wh.main(["download", str(ROOT / "requirements.lock"), str(tmp_path / "out"), "--platform", "aarch64"])
    pins = {line.split()[0] for line in seen["requirements"].splitlines()}
    assert "torch-npu==2.7.1.post2" in pins and "torch==2.7.1" in pins
    assert not any(p.startswith("nvidia-") for p in pins)  # x86_64-only entries of the universal lock
    platforms = [c.split("=", 1)[1] for c in seen["command"] if c.startswith("--platform=")]
    assert platforms[0] == "manylinux_2_35_aarch64" and "manylinux2014_aarch64" in platforms
    assert all(p.endswith("_aarch64") for p in platforms)
    for flag in ("--no-deps", "--require-hashes", "--only-binary=:all:"):
        assert flag in seen["command"]
    assert seen["command"][seen["command"].index("--python-version") + 1] == "3.11"


def test_install_is_online_unless_a_wheelhouse_is_named(tmp_path: Path, monkeypatch) -> None:
    wh = _wheelhouse_module()
    calls = []
    monkeypatch.setattr(wh.os, "execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setattr(wh, "MOUNT", tmp_path)
    lock = tmp_path / "req.lock"
    lock.write_text("")
    monkeypatch.delenv("WHEELHOUSE", raising=False)
    wh.main(["install", str(lock)])
    assert calls[-1][3:] == [
        "install",
        "--no-cache-dir",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "-r",
        str(lock),
    ]
    monkeypatch.setenv("WHEELHOUSE", "absent")
    with pytest.raises(SystemExit) as refused:
        wh.main(["install", str(lock)])
    assert refused.value.code == 1
    (tmp_path / "present").mkdir()
    monkeypatch.setenv("WHEELHOUSE", "present")
    wh.main(["install", str(lock)])
    assert calls[-1][-5:] == ["--no-index", "--find-links", str(tmp_path / "present"), "-r", str(lock)]


# --- scripts, CI and docs -----------------------------------------------------------------------------


def _ci_copy(tmp_path: Path, test_sh: str) -> Path:
    """A copy of .ci/run beside stand-ins for the scripts it calls, each logging its arguments and the test
    switches it sees."""
    root = tmp_path / "clone"
    (root / ".ci").mkdir(parents=True)
    shutil.copy2(ROOT / ".ci" / "run", root / ".ci" / "run")
    (root / "scripts").mkdir()
    log = 'echo "$(basename "$0") $* docker=${LAUNCHER_DOCKER_TESTS:-} slurm=${LAUNCHER_SLURM_TESTS:-}" >> "$CI_LOG"\n'
    for name in ("setup-env.sh", "docker-engine.sh", "slurm-cluster.sh"):
        (root / "scripts" / name).write_text("#!/bin/bash\n" + log)
    (root / "scripts" / "test.sh").write_text(
        "#!/bin/bash\n" + log + 'echo "addopts=$PYTEST_ADDOPTS" >> "$CI_LOG"\n' + test_sh
    )
    return root


def _run_ci(root: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = root / "ci.log"
    # not what the CI run around this test set: its switches, its pytest options, its CI_* knobs
    outer = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CI_") and k not in ("LAUNCHER_DOCKER_TESTS", "LAUNCHER_SLURM_TESTS", "PYTEST_ADDOPTS")
    }
    done = subprocess.run(
        ["bash", str(root / ".ci" / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**outer, "CI_LOG": str(log), **env},
    )
    return done, log.read_text().splitlines()


@pytest.mark.parametrize("need", ["0", "999999"], ids=["disk-enough", "disk-short"])
def test_ci_runs_the_readme_tests_with_the_engine_and_slurm_only_with_the_disk_for_them(
    tmp_path: Path, need: str
) -> None:
    root = _ci_copy(tmp_path, "exit 3\n")
    where = tmp_path / "engine" / "not-made-yet"  # measured on its nearest existing folder, created by no one
    # switches set outside: the no-engine path must turn them off
    done, calls = _run_ci(
        root, CI_ENGINE_DISK_GIB=need, CI_DOCKER_ROOT=str(where), LAUNCHER_DOCKER_TESTS="1", LAUNCHER_SLURM_TESTS="1"
    )
    assert done.returncode == 3, done.stdout + done.stderr  # the tests' exit code is CI's
    assert not where.parent.exists()
    assert done.stdout.startswith("ci: free disk at the start: ") and "ci: free disk at the end: " in done.stdout
    if need == "0":
        steps = [" ".join(c.split()[:2]) for c in calls[1:]]
        assert steps == [
            "docker-engine.sh install",
            "docker-engine.sh start",
            "slurm-cluster.sh install",
            "test.sh docker=1",
            "addopts= --durations=30",
            "slurm-cluster.sh stop",
            "docker-engine.sh stop",
        ]
        assert calls[0].startswith("setup-env.sh ") and calls[4].endswith("docker=1 slurm=1")
        assert "did NOT run" not in done.stdout
    else:
        assert [c.split()[0] for c in calls] == ["setup-env.sh", "test.sh", "addopts="]
        assert calls[1].endswith("docker= slurm=")
        notice = "ci: the real-engine and Slurm tests did NOT run: "
        assert done.stdout.count(notice) == 2 and "they need 999999 (CI_ENGINE_DISK_GIB)" in done.stdout


def test_ci_refuses_a_disk_gate_that_is_not_a_whole_number(tmp_path: Path) -> None:
    done, calls = _run_ci(_ci_copy(tmp_path, "exit 0\n"), CI_ENGINE_DISK_GIB="16.5")
    assert done.returncode == 2 and "ci: CI_ENGINE_DISK_GIB=16.5: give a whole number of GiB" in done.stderr
    assert [c.split()[0] for c in calls] == ["setup-env.sh"]


def test_ci_interrupts_tests_that_outrun_its_limit_so_they_report(tmp_path: Path) -> None:
    """Past CI_TEST_TIMEOUT_S the tests get SIGINT (pytest then prints its summary) and CI fails with 124."""
    root = _ci_copy(tmp_path, "trap 'echo interrupted >> \"$CI_LOG\"; exit 2' INT\nwhile :; do sleep 0.1; done\n")
    done, calls = _run_ci(root, CI_DOCKER="0", CI_TEST_TIMEOUT_S="1")
    assert done.returncode == 124 and calls[-1] == "interrupted", (done.stdout + done.stderr, calls)
    assert done.stdout.count("ci: the real-engine and Slurm tests did NOT run: CI_DOCKER=0") == 2


@pytest.mark.parametrize("script", ["docker-engine.sh", "docker-base-image.sh", "slurm-cluster.sh"])
def test_engine_scripts_parse_and_read_the_mirror_at_run_time(script: str) -> None:
    path = ROOT / "scripts" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert not re.search(r"https?://", path.read_text()), "no mirror or host address in the scripts"


def test_slurm_cluster_script_refuses_a_bad_verb_or_shared_folder_in_one_line(tmp_path: Path) -> None:
    script = str(ROOT / "scripts" / "slurm-cluster.sh")
    verb = subprocess.run(["bash", script, "begin"], capture_output=True, text=True, timeout=60)
    assert verb.returncode == 1 and "usage:" in verb.stderr and "start [DIR]" in verb.stderr
    missing = tmp_path / "no-such-folder"
    start = subprocess.run(
        ["bash", script, "start", str(tmp_path / "cluster")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SLURM_SHARED_DIR": str(missing)},
    )
    assert start.returncode == 1, start.stdout + start.stderr
    assert f"slurm-cluster: SLURM_SHARED_DIR={missing} is not a folder" in start.stderr
    assert not missing.exists() and not (tmp_path / "cluster" / "slurm.conf").exists()  # nothing written


def test_engine_status_says_when_no_engine_answers(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "DOCKER_HOST": f"unix://{tmp_path}/none.sock"}
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "docker-engine.sh"), "status"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "docker-engine: no Docker engine answers (bash scripts/docker-engine.sh install && "
        "bash scripts/docker-engine.sh start)"
    )


def test_docs_show_the_commands_the_tests_run() -> None:
    docs = (ROOT / "docs" / "containers.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for command in (
        "docker compose --profile cpu build train-cpu",
        "docker compose --profile cpu up --exit-code-from train-cpu train-cpu",
        "docker compose --profile cpu up --detach train-cpu",
        "docker compose --profile cpu stop train-cpu",
        "python3 docker/wheelhouse.py download requirements-cpu.lock wheelhouse/cpu",
        "CPU_BASE_IMAGE=local/debian-python:bookworm WHEELHOUSE=cpu docker compose --profile cpu build train-cpu",
        "export UID GID=$(id -g)",
        "bash scripts/docker-engine.sh start",
    ):
        assert command in docs, command
    assert "docker compose --profile cpu up --exit-code-from train-cpu train-cpu" in readme
    tests = (ROOT / "tests" / "containers" / "test_containers.py").read_text()
    assert '"up", "--exit-code-from", "train-cpu", "train-cpu"' in tests and '"--profile", "cpu"' in tests
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme
