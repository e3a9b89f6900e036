"""Host verbs without RUN while a run is being set up: its supervisor holds the lock and checks the config (40 to
100 s after ``docker compose up -d`` on a busy machine), and the newest folder under the runs folder is still the
previous run. ``status`` and ``stop`` then wait for the new run's folder instead of showing the previous run.

Real processes: ``launcher run`` of the demo config in its own session (a stand-in for the container's main
process; its config check imports the real LLaMA-Factory, which takes seconds), and the ``launcher`` command.
"""

from __future__ import annotations

import json
import os

from launcher.run.lock import read_owner
from launcher.state.runs import list_runs
from tests.support.common import make_config
from tests.support.fake_runs import PREFLIGHT_SKIP, launcher, launcher_bg, wait_for, write_record


def test_status_and_stop_without_run_wait_for_the_run_being_set_up(tmp_path, demo_assets):
    root = tmp_path / "runs"
    write_record(root / "demo-cpu-20261130-101500", "demo-cpu-20261130-101500", state="SUCCEEDED", exit_code=0)
    cfg = make_config(tmp_path, demo_assets, max_steps=400)
    env = {**os.environ, "LAUNCHER_PREFLIGHT_SKIP": PREFLIGHT_SKIP}
    proc = launcher_bg("run", cfg, "--quiet", env=env, log=tmp_path / "run.out")
    try:
        # the supervisor holds the lock and is checking the config: no run folder of its own yet
        owner = wait_for("the supervisor to hold the lock", lambda: read_owner(root) or None, timeout=120)
        assert owner["run_id"] is None and len(list_runs(root)) == 1, owner
        shown = launcher("status", "--root", root, "--json", timeout=300)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert shown.stderr.startswith(f"waiting for the run being set up under {root} (supervisor pid "), shown.stderr
        info = json.loads(shown.stdout)
        (new,) = [p.name for p in list_runs(root) if p.name != "demo-cpu-20261130-101500"]
        assert info["run_id"] == new, info
        stopped = launcher("stop", "--root", root, timeout=300)
        said = stopped.stdout + stopped.stderr
        assert stopped.returncode == 0 and f"run {new} ended CANCELLED" in stopped.stdout, said
        assert proc.wait(timeout=300) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # nothing waits once no run is being set up: the newest run at once, and no message
    again = launcher("status", "--root", root, "--json", timeout=120)
    assert again.returncode == 0 and again.stderr == "" and json.loads(again.stdout)["run_id"] == new
