"""Build the distributed job's command and start it in its own session.

The job is torchrun (``distribution: ddp``) or accelerate launch (``distribution: fsdp2``), one
process per device, each running ``python -m launcher.entry RUN_DIR``. The job gets its own session,
so a terminal's signals reach it only through the supervisor. Its output goes straight into the
run's log file, and from there to the terminal when the supervisor runs in the foreground.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from launcher.files import FileFollower
from launcher.state.runs import ACCELERATE_YAML


@dataclass(frozen=True)
class NodeSpec:
    """Where this node sits in a multi-node job (torchrun rendezvous); one node by default."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    @classmethod
    def from_env(cls, nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None) -> NodeSpec:
        """Config values, overridden by NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT when set."""
        env = os.environ
        return cls(
            nnodes=int(env.get("NNODES", nnodes)),
            node_rank=int(env.get("NODE_RANK", node_rank)),
            master_addr=env.get("MASTER_ADDR", master_addr or "127.0.0.1"),
            master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else master_port,
        )

    @classmethod
    def from_slurm(cls, env: Mapping[str, str]) -> NodeSpec:
        """Inside a Slurm job step (one task per node): the node count and this node's index from Slurm
        (SLURM_JOB_NUM_NODES, SLURM_NODEID); the rendezvous from MASTER_ADDR and MASTER_PORT when the batch
        script set them, else the allocation's first host and a port derived from the job id."""
        try:
            nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env["SLURM_NNODES"])
            node_rank = int(env["SLURM_NODEID"])
            job_id = int(env["SLURM_JOB_ID"])
        except (KeyError, ValueError) as err:
            raise ValueError(f"not inside a Slurm job step ({err} missing or not a number)") from None
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else slurm_port(job_id)
        return cls(nnodes=nnodes, node_rank=node_rank, master_addr=addr or "127.0.0.1", master_port=port)


def slurm_port(job_id: int) -> int:
    """The rendezvous port of a Slurm job: the batch script's ``20000 + SLURM_JOB_ID % 20000``."""
    return 20000 + job_id % 20000


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``n[1-2]`` -> ``n1``, ``gpu[007,9]`` -> ``gpu007``, ``a,b`` -> ``a``."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if not match:
        return ""
    prefix, ranges = match.group(1), match.group(2)
    return prefix + (re.split(r"[-,]", ranges)[0] if ranges else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_command(
    distribution: str, nproc_per_node: int, run_dir: Path, node: NodeSpec = NodeSpec(), entry: str = "launcher.entry"
) -> list[str]:
    """The command line that starts every rank of this node's part of the job."""
    rank_cmd = ["-m", entry, str(run_dir)]
    port = node.master_port or free_port()
    if distribution == "fsdp2":
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(run_dir / ACCELERATE_YAML),
            "--num_machines",
            str(node.nnodes),
            "--machine_rank",
            str(node.node_rank),
            "--main_process_ip",
            node.master_addr,
            "--main_process_port",
            str(port),
            *rank_cmd,
        ]
    if node.nnodes == 1:
        rendezvous = ["--standalone", "--nnodes", "1"]
    else:
        rendezvous = [
            "--nnodes",
            str(node.nnodes),
            "--node-rank",
            str(node.node_rank),
            "--master-addr",
            node.master_addr,
            "--master-port",
            str(port),
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        "--nproc-per-node",
        str(nproc_per_node),
        *rank_cmd,
    ]


def _echo(log_path: Path, offset: int, out: IO[bytes], done: threading.Event, poll_s: float = 0.2) -> None:
    """Copy what the job appends to its log onto the terminal, until the job ended and all is shown."""
    follower = FileFollower(log_path, offset=offset)
    try:
        while True:
            finished = done.is_set()  # read before the log: once set, this read sees the job's last bytes
            chunk, _ = follower.read_new()
            if chunk:
                try:
                    out.write(chunk)
                    out.flush()
                except (OSError, ValueError):
                    return  # the terminal went away; the log has everything
            elif finished:
                return
            else:
                time.sleep(poll_s)
    finally:
        follower.close()


class Job:
    """A started job: its root process, writing straight into the run's log file.

    The job's output does not pass through a pipe to the supervisor: if the supervisor died (SIGKILL,
    OOM killer), a pipe would break and every rank would die of EPIPE at its next print. With the log
    file as stdout, an orphaned job keeps training and ``launcher stop`` can still end it cleanly.
    """

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        log_path: Path,
        echo: bool,
        spawning: AbstractContextManager | None = None,
    ):
        """``spawning``: the context the root process is spawned in (the supervisor's ``StopSignals.unblocked``:
        the job must not inherit the stop signals the supervisor blocks)."""
        with open(log_path, "ab") as log, spawning or nullcontext():
            offset = log.tell()
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._done = threading.Event()
        self._echo = None
        if echo:
            self._echo = threading.Thread(
                target=_echo, args=(log_path, offset, sys.stdout.buffer, self._done), daemon=True
            )
            self._echo.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def finish(self) -> None:
        """After the job's root process ended: let the terminal copy catch up with the log."""
        self._done.set()
        if self._echo is not None:
            self._echo.join(timeout=10)
