"""Two nodes on loopback: one launcher per node, torchrun's rendezvous joins them, the tiny model trains.

Each "node" is a separate `launcher run` with its own runs folder (its own lock), as on two hosts;
NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT come from the environment, as a cluster would set them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.run.job import free_port
from tests.support.common import REPO, make_config, only_run_dir, read_jsonl

pytestmark = pytest.mark.slow


def test_two_nodes_on_loopback_train_the_tiny_model(tmp_path, demo_assets):
    port = free_port()
    procs = []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        cfg = make_config(folder, demo_assets, launcher={"nnodes": 2}, max_steps=2, save_steps=2, eval_steps=2)
        env = {
            **os.environ,
            "NNODES": "2",
            "NODE_RANK": str(node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "launcher", "run", str(cfg), "--quiet"],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)

    node0 = only_run_dir(tmp_path / "node0" / "runs")
    node1 = only_run_dir(tmp_path / "node1" / "runs")
    log0 = (node0 / "launcher.log").read_text()
    assert "world size: 2" in log0
    assert "--node-rank" in json.loads((node0 / "status.json").read_text())["command"]
    # world rank 0 lives on node 0: it writes the trainer log and the adapter
    records = read_jsonl(node0 / "output" / "trainer_log.jsonl")
    assert records[-1]["current_steps"] == 2 == records[-1]["total_steps"]
    assert (node0 / "output" / "adapter_model.safetensors").is_file()
    status1 = json.loads((node1 / "status.json").read_text())
    assert status1["state"] == "SUCCEEDED" and status1["node"]["node_rank"] == 1
