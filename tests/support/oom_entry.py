"""A training entry for the out-of-memory tests: the real ``launcher.entry`` plus torch's out-of-memory error planted
in one phase, as ``tests.support.fault_entry`` plants a kill.

    OOM_SPEC='{"phase": "recompute", "step": 2, "layer": 3}' python -m tests.support.oom_entry RUN_DIR

A CPU has no device allocator that runs out, so the error is raised where the device's would be, with the
message CUDA's allocator gives: ``forward`` (a decoder layer's training forward), ``recompute`` (the same layer
run again inside the backward by its checkpoint), ``backward`` (the gradient reaching the layer's output),
``optimizer`` (inside ``optimizer.step``), ``evaluation`` (a decoder layer's forward in evaluation), ``save`` (the
Trainer's ``save_model`` of a checkpoint) and ``all_gather`` (FSDP2's ``foreach_all_gather``, or with one rank the
unsharded buffer's ``alloc_storage``). The plant finds the phase on its own (module flags, autograd's graph task,
the optimizer's hook), not through the tracker under test. Only rank 0 of attempt 1 plants.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from transformers import TrainerCallback

from launcher.rank import entry

SPEC_ENV = "OOM_SPEC"
MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB "
    "is free. Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch "
    "but unallocated."
)


def _oom():
    import torch

    return torch.OutOfMemoryError(MESSAGE)


def _raise_in_backward(grad):
    raise _oom()


class PlantOutOfMemory(TrainerCallback):
    def __init__(self, spec: dict):
        self.spec = spec
        self.phase, self.at_step, self.layer = spec["phase"], int(spec.get("step", 1)), int(spec.get("layer", 0))
        self.step = 0

    def _now(self) -> bool:
        return self.step == self.at_step

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step  # evaluation and saving after the step belong to it
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import torch

        layer = next(m for name, m in model.named_modules() if re.search(rf"layers\.{self.layer}$", name))
        in_backward = torch._C._current_graph_task_id

        def before(module, args):
            if not self._now():
                return
            if self.phase == "forward" and module.training and in_backward() == -1:
                raise _oom()
            if self.phase == "recompute" and module.training and in_backward() != -1:
                raise _oom()
            if self.phase == "evaluation" and not module.training:
                raise _oom()

        def after(module, args, output):
            if self.phase == "backward" and self._now() and module.training and in_backward() == -1:
                output.register_hook(_raise_in_backward)

        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)
        if self.phase == "optimizer":
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(lambda opt, a, k: self._raise_now())
        if self.phase == "save":
            import transformers

            transformers.Trainer.save_model = self._failing(transformers.Trainer.save_model)
        if self.phase == "all_gather":
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group

            for name in ("foreach_all_gather", "alloc_storage"):  # several ranks; one rank allocates directly
                setattr(_fsdp_param_group, name, self._failing(getattr(_fsdp_param_group, name)))
        return control

    def _failing(self, original):
        def call(*args, **kwargs):
            self._raise_now()
            return original(*args, **kwargs)

        return call

    def _raise_now(self) -> None:
        if self._now():
            raise _oom()


def main() -> int:
    run_dir = Path(sys.argv[1]).resolve()
    spec = json.loads(os.environ.get(SPEC_ENV) or "{}")
    attempt = json.loads((run_dir / "launch.json").read_text()).get("attempt", 1)
    chosen = spec and attempt == 1 and os.environ.get("RANK", "0") == "0"
    return entry.main(sys.argv[1:], callbacks=(PlantOutOfMemory(spec),) if chosen else ())


if __name__ == "__main__":
    sys.exit(main())
