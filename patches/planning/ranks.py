"""Every rank applies the same layer plan.

Each rank measures its own layers on its own batch (``meter``), so the costs differ a little (the
sequence length, the timing) and a budget plan differs with each rank's peak. Two all-reduces make the plan one:

1. ``agree_costs`` (end of step 1): per kind, the largest bytes and seconds per token any rank measured
   (MAX), expressed again at this rank's sequence length. Every rank then orders the kinds alike, so a count
   plan is the same everywhere, and a budget plan prices a layer alike.
2. ``agree_counts`` (end of step 1, and at the step-2 correction): per kind, the fewest un-checkpointed layers
   any rank chose (MIN). That plan is within every rank's own, so it keeps every rank within its budget.

Every rank calls both whatever it measured (a collective that one rank skips would hang the others), in the
order of ``kinds``, which comes from the model's structure and is the same on every rank. Without an
initialized process group (one process) both return their input. The tensors live where the process group
reduces: the CPU for gloo, the rank's device for NCCL and HCCL.
"""

from __future__ import annotations

from .budget import LayerCost


def _world(backend: str):
    """``(torch.distributed, device)`` when this process is one of several ranks, else None."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if backend == "cpu" or dist.get_backend() == "gloo":
        return dist, torch.device("cpu")
    return dist, torch.device(backend, getattr(torch, backend).current_device())


def _all_reduce(values: list[float], backend: str, op_name: str) -> list[float]:
    world = _world(backend)
    if world is None or not values:
        return values
    import torch

    dist, device = world
    tensor = torch.tensor(values, dtype=torch.float32, device=device)  # float32: every backend reduces it
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op_name))
    return tensor.cpu().tolist()


def agree_costs(
    costs: dict[str, LayerCost], kinds: dict[str, int], seq_len: int | None, backend: str
) -> tuple[dict[str, LayerCost], int | None]:
    """The costs every rank plans from, at this rank's ``seq_len`` (the longest any rank saw, if this one
    measured nothing), and that length. ``kinds``: every planned kind and its number of layers."""
    names = sorted(kinds)
    per_token = [costs[k].saved_bytes / costs[k].seq_len if k in costs else 0.0 for k in names]
    seconds = [costs[k].forward_s / costs[k].seq_len if k in costs else 0.0 for k in names]
    reduced = _all_reduce([*per_token, *seconds, float(seq_len or 0)], backend, "MAX")
    tokens = seq_len or int(reduced[-1]) or None
    agreed = {}
    for i, kind in enumerate(names):
        if reduced[i] > 0 and tokens:
            agreed[kind] = LayerCost(
                kind, kinds[kind], round(reduced[i] * tokens), round(reduced[len(names) + i] * tokens, 6), tokens
            )
    return agreed, tokens


def agree_counts(chosen: dict[str, int], kinds: dict[str, int], backend: str) -> dict[str, int]:
    """Per kind, the fewest layers any rank leaves un-checkpointed (kinds at zero left out)."""
    names = sorted(kinds)
    reduced = _all_reduce([float(chosen.get(k, 0)) for k in names], backend, "MIN")
    return {kind: int(n) for kind, n in zip(names, reduced, strict=True) if int(n) > 0}
