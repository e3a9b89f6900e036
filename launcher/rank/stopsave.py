"""Save on stop, in each rank: a checkpoint at the next step boundary, then a clean exit.

``launcher stop``, a SIGTERM from ``docker stop`` or the hang watchdog make the supervisor write
``RUN_DIR/save_request.json``; a SIGTERM that reaches a rank directly (torchrun forwards its own) sets a
flag instead of killing it (unless ``launcher stop --now`` sent it: its request says so, and the rank dies as
it would without this module). At every optimizer step's end ``StopSaveCallback`` looks at both and, when
asked, sets ``should_save``, ``should_log`` and ``should_training_stop``: the HF Trainer then writes a
complete ``checkpoint-N`` (adapter, optimizer, scheduler, trainer state) and leaves its loop. With
several ranks the decision is all-reduced (MAX) every step, so that all ranks stop at the same step;
one rank that saw the request is enough. After the save, local rank 0 writes ``stop_saved.json`` (step
and folder) and ``on_train_end`` raises ``StoppedAfterSave``, which skips LLaMA-Factory's final save and
evaluation (the run did not finish; the checkpoint is what ``launcher resume`` continues from).

Local rank 0 writes ``save_on_stop.json`` once training begins: the supervisor waits for the job to exit
on its own only when that file says the job can (a custom ``launcher.entry`` without this callback gets
SIGTERM at once, as before).

The files of this exchange are read and written by ``state/stop.py``, the stop protocol the supervisor and
``launcher stop`` use too. Layer 3, like ``entry.py`` (which installs it): imports ``state`` only; torch and
transformers are imported lazily, in the rank.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from launcher.state.stop import announce_save, read_stop_request, record_saved, save_asked, skips_save


class StoppedAfterSave(Exception):  # noqa: N818  (not an error: how the rank leaves training after the save)
    """Raised from ``on_train_end`` after a requested save; ``entry`` turns it into exit code 0."""

    def __init__(self, step: int):
        super().__init__(f"stopped after saving checkpoint-{step} on request")
        self.step = step


_SIGNALLED: list[int] = []  # the SIGTERMs this rank received while training
_TRAINING = False
_RUN_DIR: list[Path] = []  # where `launcher stop` leaves its request (set by install_sigterm_handler)


def _stop_now() -> bool:
    """`launcher stop --now` asked for no save: its request (``stop_request.json``) says ``now``."""
    return bool(_RUN_DIR) and skips_save(read_stop_request(_RUN_DIR[0]))


def _on_sigterm(signum: int, _frame: Any) -> None:
    # before training (nothing to save), a second SIGTERM, or `stop --now`: die as before
    if not _TRAINING or _SIGNALLED or _stop_now():
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _SIGNALLED.append(signum)


def install_sigterm_handler(run_dir: Path) -> None:
    """In the rank's main thread: the first SIGTERM during training asks for a save instead of killing, unless
    `launcher stop --now` sent it (whether torchrun forwards one SIGTERM or two, the rank then dies at once)."""
    _RUN_DIR[:] = [run_dir]
    signal.signal(signal.SIGTERM, _on_sigterm)


def _callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


def make_callback(run_dir: Path) -> Any:
    """The ``TrainerCallback`` for ``run_exp(callbacks=[...])``."""

    class StopSaveCallback(_callback_base()):
        def __init__(self) -> None:
            self.run_dir = run_dir
            self.stopping_at: int | None = None
            self.local_zero = os.environ.get("LOCAL_RANK", "0") == "0"

        def on_train_begin(self, args, state, control, **kwargs):
            global _TRAINING
            _TRAINING = True
            if self.local_zero:
                announce_save(self.run_dir, state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if self.stopping_at is not None:
                return control
            if _agree(bool(_SIGNALLED) or save_asked(self.run_dir), args):
                self.stopping_at = state.global_step
                control.should_save = True
                control.should_log = True
                control.should_training_stop = True
            return control

        def on_save(self, args, state, control, **kwargs):
            if self.stopping_at is not None and state.global_step == self.stopping_at and self.local_zero:
                record_saved(self.run_dir, state.global_step, signalled=bool(_SIGNALLED))
            return control

        def on_train_end(self, args, state, control, **kwargs):
            global _TRAINING
            _TRAINING = False
            if self.stopping_at is not None:
                raise StoppedAfterSave(self.stopping_at)
            return control

    return StopSaveCallback()


def _agree(mine: bool, args: Any) -> bool:
    """True on every rank when any rank wants to stop (one all-reduce per step when distributed)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=args.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
