"""Helpers every test wing uses: the repository root, the demo config writer, the real ``launcher`` command,
reading JSON lines and finding a run folder."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo_cpu.yaml"


def make_config(
    tmp_path: Path,
    assets: dict[str, Path],
    launcher: dict[str, Any] | None = None,
    name: str = "run.yaml",
    **lf: Any,
) -> Path:
    """Write the demo config with the demo assets and outputs under ``tmp_path``; override keys."""
    data = yaml.safe_load(DEMO_CONFIG.read_text())
    data["model_name_or_path"] = str(assets["model"])
    data["dataset_dir"] = str(assets["data"])
    data["launcher"]["output_root"] = str(tmp_path / "runs")
    data["launcher"].update(launcher or {})
    for key, value in lf.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def launcher_cmd(*args: str | Path, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real ``launcher`` command in a child process and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "launcher", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def only_run_dir(root: Path) -> Path:
    runs = [p for p in root.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"expected one run folder in {root}, found {runs}"
    return runs[0]


# The smallest well-formed safetensors file (a header of no tensors): what a fake checkpoint holds where the
# launcher reads the weights' header before it takes the checkpoint (state/checkpoints.damage).
EMPTY_SAFETENSORS = struct.pack("<Q", 2) + b"{}"
