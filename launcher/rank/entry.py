"""The training entry point: one of these runs per rank, under torchrun or accelerate launch.

    python -m launcher.entry RUN_DIR

It reads ``RUN_DIR/launch.json`` (written by ``launcher run``/``start``), applies the enabled
runtime patches in the registry's order, and only then hands the exact LLaMA-Factory YAML of the
run to LLaMA-Factory's own training entry (``llamafactory.train.tuner.run_exp``). Patches must be
in place before the model is built, which is why they are applied here and not in a callback.

The callbacks it adds are save on stop (``stopsave.py``): a stop request or a SIGTERM makes the rank
save a checkpoint at the next step boundary and exit 0 (``StoppedAfterSave``), instead of dying; and the phase
tracker (``oomtrack.py``), so that a rank that runs out of memory records the phase, step and layer it was in.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import yaml

from launcher.files import DiskTolerantStream, disk_error, write_json_or_warn
from launcher.rank import oomtrack
from launcher.rank.stopsave import StoppedAfterSave, install_sigterm_handler, make_callback
from launcher.results import best_adapter
from launcher.state.runs import ERROR_RECORD, ERRORS_DIR, LAUNCH_FILE, PREFLIGHT_FILE, PROOF_DIR


def write_error_file(run_dir: Path, exc: BaseException) -> Path:
    """Record this rank's failure as ``errors/rank<N>.json`` (the root cause the supervisor reports)."""
    rank = os.environ.get("RANK", "0")
    path = run_dir / ERRORS_DIR / ERROR_RECORD.format(rank=rank)
    record = {
        "rank": int(rank),
        "time": time.time(),
        "pid": os.getpid(),
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "disk": disk_error(exc),  # the disk refused a write (errno, path, free bytes): the cause to name
        "out_of_memory": None,
    }
    if oomtrack.is_out_of_memory(exc):  # the phase, step and layer it happened in, and the fix for that phase
        record["out_of_memory"] = oomtrack.describe(exc)
        snapshot = oomtrack.dump_snapshot(run_dir, rank)
        record["out_of_memory"]["snapshot"] = snapshot.name if snapshot else None
    write_json_or_warn(path, record, "this rank's error record")  # never mask the error itself
    return path


def main(argv: list[str] | None = None, callbacks: tuple = ()) -> int:
    """Train one rank; ``callbacks`` are extra Trainer callbacks (a wrapping entry may add its own)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m launcher.entry RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    # before any library keeps a reference to them: a disk that refuses the run's log must not end training
    sys.stdout, sys.stderr = DiskTolerantStream(sys.stdout), DiskTolerantStream(sys.stderr)
    try:
        return _train(run_dir, callbacks)
    except StoppedAfterSave as stopped:
        print(f"rank {os.environ.get('RANK', '0')}: {stopped}", file=sys.stderr, flush=True)
        _leave_process_group()
        return 0
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            write_error_file(run_dir, exc)
        raise


def _leave_process_group() -> None:
    """Leave together: every rank agreed to stop after the same step (stopsave._agree), but rank 0 still writes
    the checkpoint's last files after the final collective; a barrier keeps a faster rank from tearing down its
    connections while another is still on its way out, so each exits 0 on its own terms."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # leaving is best effort: the process ends next
        pass


def run_facts(run_dir: Path, launch: dict) -> dict:
    """``launch.json``'s facts, plus the kernel choice preflight made on NPU (``preflight.json``'s
    ``kernel_choice``), which ``deltanet_routing`` and ``fused_ops`` bind, and its memory row's
    ``offload_inputs`` decision, which ``checkpoint_all_layers`` takes for ``auto``."""
    from launcher.files import read_json_object

    facts = dict(launch.get("facts") or {})
    preflight = read_json_object(run_dir / PREFLIGHT_FILE)
    if isinstance(preflight, dict) and preflight.get("kernel_choice") is not None:
        facts["kernel_choice"] = preflight["kernel_choice"]
    if isinstance(preflight, dict) and isinstance(preflight.get("offload_inputs"), dict):
        facts["offload_inputs"] = preflight["offload_inputs"]
    return facts


def _train(run_dir: Path, callbacks: tuple = ()) -> int:
    launch = json.loads((run_dir / LAUNCH_FILE).read_text())
    install_sigterm_handler(run_dir)

    import patches

    patches.apply_enabled(
        launch["patches"], backend=launch["backend"], proof_dir=run_dir / PROOF_DIR, facts=run_facts(run_dir, launch)
    )

    from launcher.data.privacy import log_examples_wanted, protect_training_log

    if not log_examples_wanted(run_dir):  # no training text in the log unless the config asks for it
        protect_training_log()

    from llamafactory.train.tuner import run_exp

    args = yaml.safe_load((run_dir / launch["llamafactory_yaml"]).read_text())
    profile = launch.get("profile")
    if profile:  # `launcher profile`
        from launcher.rank.profiling import ProfileCallback

        callbacks = (*callbacks, ProfileCallback(run_dir, launch["backend"], profile["warmup"], profile["steps"]))
    tracker = oomtrack.make_callback(launch["backend"], int(launch.get("memory_history_steps") or 0))
    run_exp(args=args, callbacks=[make_callback(run_dir), tracker, *callbacks])
    if os.environ.get("RANK", "0") == "0" and best_adapter.wanted(args) and args.get("do_train", True):
        best_adapter.keep_best_adapter(Path(args["output_dir"]))  # under FSDP2 the Trainer cannot (results/)
    return 0


if __name__ == "__main__":
    sys.exit(main())
