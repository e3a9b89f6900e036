"""Start the distributed job and supervise it in the foreground.

The job is torchrun (``distribution: ddp``) or accelerate launch (``distribution: fsdp2``), one
process per device, each running ``python -m launcher.entry RUN_DIR``. The job gets its own session
so a terminal's signals reach it only through us; stopping it signals the whole process tree
(torchrun and every rank, found with psutil), waits a grace period, then kills what is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from .backend import Backend
from .config import RunConfig
from .rundir import ACCELERATE_YAML, RunDir

DEFAULT_GRACE_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_command(config: RunConfig, run_dir: RunDir) -> list[str]:
    """The command line that starts every rank of the job."""
    entry = ["-m", "launcher.entry", str(run_dir.path)]
    launcher = config.launcher
    if launcher.distribution == "fsdp2":
        return [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(run_dir.path / ACCELERATE_YAML),
            "--main_process_port", str(free_port()),
            *entry,
        ]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(launcher.nproc_per_node),
        *entry,
    ]  # fmt: skip


def job_env(backend: Backend) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    # The repository root, so every rank imports this launcher and its patches.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if backend.name == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run stays on the CPU even on a GPU host
    return env


@dataclass
class JobResult:
    exit_code: int | None = None  # the job's own exit status, when it exited
    signal: int | None = None  # the signal that killed it, when it was killed
    stop_signal: int | None = None  # the signal we received and passed on, if any
    pids: list[int] = field(default_factory=list)

    @property
    def shell_code(self) -> int:
        """The code a shell would show: the exit status, or 128 + signal."""
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code if self.exit_code is not None else 1


def _tee(stream: IO[bytes], log: IO[bytes], echo: IO[bytes] | None) -> None:
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        if echo is not None:
            echo.write(line)
            echo.flush()


def stop_tree(root_pid: int, sig: int = signal.SIGTERM, grace_s: float = DEFAULT_GRACE_S) -> list[int]:
    """Send ``sig`` to ``root_pid`` and all its descendants; SIGKILL whatever outlives ``grace_s``.

    Returns:
        The pids that had to be killed.
    """
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


def run_job(cmd: list[str], env: dict[str, str], log_path: Path, echo: bool = True,
            grace_s: float = DEFAULT_GRACE_S, on_start=None) -> JobResult:  # fmt: skip
    """Run the job to its end, copying its output to ``log_path`` (and the terminal if ``echo``).

    SIGINT, SIGTERM and SIGHUP received meanwhile stop the whole job tree gracefully.
    """
    result = JobResult()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        result.pids = [proc.pid]
        if on_start is not None:
            on_start(proc.pid)
        stopper: list[threading.Thread] = []

        def _handle(signum, _frame):
            if result.stop_signal is None:
                result.stop_signal = signum
                t = threading.Thread(target=stop_tree, args=(proc.pid, signal.SIGTERM, grace_s), daemon=True)
                t.start()
                stopper.append(t)

        previous = {s: signal.signal(s, _handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            tee = threading.Thread(
                target=_tee, args=(proc.stdout, log, sys.stdout.buffer if echo else None), daemon=True
            )
            tee.start()
            code = proc.wait()
            tee.join(timeout=10)
            for t in stopper:
                t.join()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if code < 0:
        result.signal = -code
    else:
        result.exit_code = code
    return result
