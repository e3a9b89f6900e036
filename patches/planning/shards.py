"""What one rank holds after FSDP2 sharded the model: frozen and trainable shards, and each unit's share.

Read by ``fsdp2_frozen_dtype`` right after accelerate's ``fsdp2_prepare_model`` returns, on every rank, so the
proof shows (a) the dtype and local bytes of the frozen base and of the trainable parameters, and (b) for each
FSDP2 unit (a module ``fully_shard`` made an ``FSDPModule``) the bytes of its parameters this rank holds against
the whole unit's: with N ranks each holds about 1/N of every unit (FSDP2 shards dim 0, padding the last rank).
"""

from __future__ import annotations

from typing import Any


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def shard_census(model) -> dict[str, Any]:
    """``frozen``/``trainable``: dtypes, local and full bytes; ``units``: name -> local, full bytes and shapes of
    the unit's first parameter (its shard and the whole)."""
    from torch.distributed.fsdp import FSDPModule

    sides: dict[str, dict[str, Any]] = {}
    for param in model.parameters():
        side = sides.setdefault(
            "trainable" if param.requires_grad else "frozen",
            {"dtypes": set(), "local_bytes": 0, "full_bytes": 0, "tensors": 0},
        )
        side["dtypes"].add(str(param.dtype).replace("torch.", ""))
        side["local_bytes"] += _bytes(_local(param))
        side["full_bytes"] += param.numel() * param.element_size()
        side["tensors"] += 1
    for side in sides.values():
        side["dtypes"] = sorted(side["dtypes"])
    units: dict[str, dict[str, Any]] = {}
    owned: set[int] = set()
    fsdp_modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    for name, module in reversed(fsdp_modules):  # innermost first: a parameter belongs to its nearest unit
        params = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        if params:
            units[name or "<root>"] = {
                "local_bytes": sum(_bytes(_local(p)) for p in params),
                "full_bytes": sum(_bytes(p) for p in params),
                "parameters": len(params),
                "first_shape": list(params[0].shape),
                "first_local_shape": list(_local(params[0]).shape),
            }
    return {"frozen": sides.get("frozen"), "trainable": sides.get("trainable"), "units": units}
