"""What Slurm says of a run's batch job (host side, no torch): ``scontrol show job -o JOB``, read as text.

A run submitted with ``launcher submit`` records its Slurm job id (``RunRecord.slurm``); ``reconcile`` asks
here for the job's state, so that ``launcher status`` shows it next to the run state (a job waiting in the
queue: ``PENDING`` with Slurm's reason) and a job Slurm has ended without the run recording an end is seen as
such (``NODE_FAIL``: the run is ``NODE_LOST``). Nothing here writes.

Without accounting storage ``sacct`` does not answer, and an ended job stays visible to ``scontrol`` only for
MinJobAge seconds: after that its state is ``gone``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass

# Slurm's job states in which the job's processes may be alive, or will be (queued, requeued)
SLURM_LIVE = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESV_DEL_HOLD",
    }
)
GONE = "gone"  # Slurm no longer knows the job (ended more than MinJobAge ago)
# How long node 0's supervisor of a Slurm run, about to record a failed end, waits for Slurm to call a node of
# the job lost (``lost_node``). slurmctld marks a node that stopped answering NOT_RESPONDING, then DOWN (the
# job NODE_FAIL), SlurmdTimeout after its last answer: 10 s on the test cluster (scripts/slurm-cluster.sh);
# twice that plus a margin for slurmctld's ping period. A site whose SlurmdTimeout is longer (Slurm's default
# is 300 s) gets NODE_LOST only for what Slurm has noticed within this wait; a job that failed for another
# reason costs this wait once, at its end.
SLURMD_TIMEOUT_S = 10.0
NODE_LOST_WAIT_S = 2 * SLURMD_TIMEOUT_S + 5.0
LOST_NODE_FLAGS = frozenset({"DOWN", "NOT_RESPONDING", "FAIL", "FAILING"})  # a node's State=, split on "+"
_FIELD = re.compile(r"(\w+)=(\S*)")


@dataclass
class SlurmJobView:
    """Slurm's answer: ``state`` (its word, ``gone``, or None when no Slurm answers here), the reason a pending
    job waits, the nodes, the exit code (``0:0``), and why nothing answered (``error``)."""

    job_id: str
    state: str | None = None
    reason: str | None = None
    nodes: str | None = None
    exit_code: str | None = None
    error: str | None = None

    @property
    def live(self) -> bool | None:
        """True while queued or running; False once ended or gone; None when unknown."""
        return None if self.state is None else self.state in SLURM_LIVE

    def describe(self) -> str:
        """``job 42 RUNNING on n[1-2]``, ``job 42 PENDING (Resources)``, ``job 42 gone from Slurm's memory``."""
        if self.state is None:
            return f"job {self.job_id}: state unknown ({self.error or 'no answer from Slurm'})"
        if self.state == GONE:
            return f"job {self.job_id}: no longer known to Slurm (ended)"
        text = f"job {self.job_id} {self.state}"
        if self.state == "PENDING" and self.reason and self.reason != "None":
            text += f" ({self.reason})"
        elif self.nodes and self.nodes != "(null)":
            text += f" on {self.nodes}"
        if self.state not in SLURM_LIVE and self.exit_code:
            text += f", exit {self.exit_code}"
        return text


def parse_show_job(job_id: str, text: str) -> SlurmJobView:
    """``scontrol show job -o``'s one line (``Key=Value`` pairs) as a view."""
    fields = dict(_FIELD.findall(text))
    return SlurmJobView(
        job_id,
        state=fields.get("JobState"),
        reason=fields.get("Reason"),
        nodes=fields.get("NodeList"),
        exit_code=fields.get("ExitCode"),
    )


def query_job(job_id: str | int, timeout_s: float = 10.0) -> SlurmJobView:
    """Ask Slurm (``scontrol``) about ``job_id``."""
    job = str(job_id)
    done = run_scontrol(["show", "job", "-o", job], timeout_s)
    if isinstance(done, str):
        return SlurmJobView(job, error=done)
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return SlurmJobView(job, state=GONE)
        said = (done.stderr or done.stdout).strip().splitlines()
        return SlurmJobView(job, error=said[-1] if said else f"scontrol exit {done.returncode}")
    # a requeued job's array of lines: the last one is the current
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return parse_show_job(job, lines[-1] if lines else "")


def run_scontrol(args: list[str], timeout_s: float) -> subprocess.CompletedProcess | str:
    """``scontrol ARGS``: its completed process, or why it did not run (no scontrol here, no answer in time)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return "no scontrol on this machine"
    try:
        return subprocess.run([scontrol, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)


def _scontrol_show(what: str, name: str, timeout_s: float) -> str | None:
    done = run_scontrol(["show", what, "-o", name], timeout_s)
    return done.stdout if not isinstance(done, str) and done.returncode == 0 else None


def node_states(nodes: str, timeout_s: float = 10.0) -> dict[str, str]:
    """``scontrol show node -o NODES`` (a Slurm node list, ``n[1-2]``): each node's ``State`` (``IDLE``,
    ``MIXED+NOT_RESPONDING``, ``DOWN+NOT_RESPONDING``); empty when Slurm does not answer."""
    text = _scontrol_show("node", nodes, timeout_s) or ""
    states = {}
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        if "NodeName" in fields:
            states[fields["NodeName"]] = fields.get("State", "")
    return states


def lost_nodes(states: dict[str, str]) -> dict[str, str]:
    """The nodes among ``states`` that Slurm calls lost (down, not responding, failing)."""
    return {
        name: state
        for name, state in states.items()
        if LOST_NODE_FLAGS & set(state.replace("*", "+NOT_RESPONDING").split("+"))
    }


def lost_node(
    job_id: str | int, nodes: str | None = None, wait_s: float = NODE_LOST_WAIT_S, poll_s: float = 1.0
) -> str | None:
    """Why Slurm says job ``job_id`` lost a node (its state ``NODE_FAIL``, its reason ``NodeDown``, or a node
    of ``nodes``, the job's allocation, down or not responding), asking until it does or ``wait_s`` has
    passed: ``Slurm job 42 COMPLETING (NodeDown); node n2 DOWN+NOT_RESPONDING``; None when Slurm says no such
    thing (or does not answer) within the wait.

    ``nodes``: the allocation as the job started (``SLURM_JOB_NODELIST``); once Slurm ends the job for a
    lost node, its ``NodeList`` no longer names that node (seen: ``COMPLETING``, ``Reason=NodeDown``,
    ``NodeList=n1`` of ``n[1-2]``). Without it, the job's current ``NodeList``."""
    deadline = time.monotonic() + wait_s
    while True:
        view = query_job(job_id)
        where = nodes or (view.nodes if view.nodes != "(null)" else None)
        lost = lost_nodes(node_states(where)) if where else {}
        if view.state == "NODE_FAIL" or view.reason == "NodeDown" or lost:
            said = f"Slurm job {job_id} {view.state}" + (
                f" ({view.reason})" if view.reason not in (None, "None") else ""
            )
            if lost:
                said += "; " + ", ".join(f"node {name} {state}" for name, state in sorted(lost.items()))
            return said
        if view.state is None or view.state == GONE or time.monotonic() >= deadline:
            return None
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
