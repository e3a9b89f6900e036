"""The host side as the README installs it: ``pip install .`` (no ``train`` extra, no torch) in a fresh venv, and
every host verb on a finished run.

The run is the suite's real demo run (``tests/support/run_fixtures.py``: the tiny model trained once per session
through ``launcher run``), copied so that verify's and report's files land in this test's folder. The verbs run as
the venv's own ``launcher`` script from a folder outside the repository, so nothing of this checkout or of the
development venv can stand in for what the host install lacks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.common import REPO
from tests.support.run_fixtures import real_demo_run

# what a host copy of the project needs; the rest (venvs, wheelhouses, outputs, caches) stays behind
_NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "wheelhouse",
    "outputs",
    "build",
    "demo",
    "logs",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
)
INSTALL_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def host_venv(tmp_path_factory) -> Path:
    """A fresh venv with the project installed from a copy of the tree, base dependencies only."""
    base = tmp_path_factory.mktemp("host")
    source = base / "source"
    shutil.copytree(REPO, source, ignore=_NOT_COPIED)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(source)],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # setuptools' deprecated `license = {text = ...}` table printed a page of warnings at every install
    assert "License" not in out.stderr and "license" not in out.stderr, out.stderr[-3000:]
    return venv


def _host(venv: Path, cwd: Path, *args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / "launcher"), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_every_host_verb_runs_on_a_finished_run_without_torch(host_venv, tmp_path_factory, demo_assets, tmp_path):
    torch = subprocess.run([str(host_venv / "bin" / "python"), "-c", "import torch"], capture_output=True, text=True)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr, torch.stderr
    trained = real_demo_run(tmp_path_factory, demo_assets)
    root = tmp_path / "runs"
    run = shutil.copytree(trained, root / trained.name)
    run_id = run.name
    for made_by_the_verbs in ("verify.json", "report.md", "report.json", "loss.png"):  # the run's own acceptance
        (run / made_by_the_verbs).unlink(missing_ok=True)
    outputs = {}
    for verb, *args in (("status",), ("list",), ("logs",), ("stop",), ("resume",), ("verify",), ("report",)):
        rest = [] if verb == "list" else [run_id]
        outputs[verb] = out = _host(host_venv, tmp_path, verb, *rest, "--root", root, *args)
        assert "Traceback" not in out.stderr and "ModuleNotFoundError" not in out.stderr, (verb, out.stderr[-3000:])
    ok = {verb: out for verb, out in outputs.items() if verb != "resume"}
    assert all(out.returncode == 0 for out in ok.values()), {v: o.stdout + o.stderr for v, o in ok.items()}
    assert "SUCCEEDED" in outputs["status"].stdout and run_id in outputs["list"].stdout
    job_log = (run / "launcher.log").read_text().strip().splitlines()
    assert outputs["logs"].stdout.strip().splitlines()[-3:] == job_log[-3:]  # the end of the job's own log
    assert outputs["stop"].stdout.strip() == f"run {run_id} already ended: SUCCEEDED"
    # a SUCCEEDED run is not resumed: one line that says why, exit 2, nothing started
    resume = outputs["resume"]
    assert resume.returncode == 2, resume.stdout + resume.stderr
    assert resume.stderr.startswith(f"error: run {run_id} ended SUCCEEDED; only stopped or failed runs are resumed")
    assert resume.stderr.count("\n") == 1 and resume.stdout == ""
    assert "PASS" in outputs["verify"].stdout and (run / "verify.json").is_file()  # numpy read the adapter
    assert (run / "report.md").is_file() and (run / "loss.png").stat().st_size > 0  # matplotlib drew the curves
