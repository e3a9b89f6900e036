"""Random weights built per rank under FSDP2: no rank ever holds the whole model.

Used by ``benchmarks.bench_entry`` when the rank runs under ``accelerate launch`` with FSDP2
(``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``, which accelerate sets for every rank), for a model folder
marked ``random_init.json``:

1. ``build_on_meta``: ``from_pretrained`` of the marked folder builds the model on the meta device (no memory);
   LLaMA-Factory then adds LoRA there too (PEFT puts the adapters on the base layer's device, meta).
2. ``materialize_trainable`` (before ``Trainer.create_optimizer``): the trainable parameters (LoRA, a few MB)
   get real storage on the rank's device. accelerate 1.11 ``Accelerator._prepare_fsdp2`` maps the optimizer's
   parameters to the sharded ones by ``data_ptr()``; every meta tensor has data_ptr 0, so with the adapters
   still on meta every optimizer entry would map to one and the same parameter.
3. accelerate's own ``fsdp2_prepare_model`` shards the model (``fully_shard`` per wrapped class, then the root),
   with the product's ``fsdp2_frozen_dtype`` patch around it (float32 masters for the trainable parameters only,
   and on a CPU job FSDP at all): on the meta device this costs nothing.
4. ``materialize_shards`` (wrapped around ``fsdp2_prepare_model``): ``to_empty`` allocates each rank's local
   shards on its device (FSDP2's ``FSDPModule._apply`` re-registers the sharded parameters), then
   transformers' ``initialize_weights`` and PEFT's ``reset_lora_parameters`` fill them with random values
   (DTensor random ops: each shard draws its own part on CUDA-like devices; on a CPU mesh every rank draws
   locally, which a benchmark of the plumbing does not mind). Non-persistent buffers (rotary ``inv_freq``) are
   recomputed by the same ``initialize_weights``.

The rank's bench record gets ``model_build`` with how the model was built and the bytes this rank
materialized against the bytes of the whole model in the same dtypes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from patches.fsdp2_frozen_dtype import fsdp2_rank  # noqa: F401  (the benchmark's ranks ask what the patch asks)

BENCH_FLAG = "_bench_random_init"  # set on the PreTrainedModel built here: only that model is materialized


def build_on_meta(cls, config, dtype):
    """The model of ``config`` on the meta device, flagged for ``materialize_shards``."""
    import torch

    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    setattr(model, BENCH_FLAG, True)
    return model


def flagged_model(model):
    """The PreTrainedModel built by ``build_on_meta`` inside ``model`` (PEFT and FSDP wrappers included)."""
    return next((m for m in model.modules() if getattr(m, BENCH_FLAG, False)), None)


def materialize_trainable(model, device: str) -> int:
    """Give the trainable parameters still on meta real storage (zeros) on ``device``; returns the bytes.

    Their values do not matter yet: ``materialize_shards`` initializes every parameter after sharding.
    """
    import torch

    done = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad and param.is_meta:
                module.register_parameter(name, torch.nn.Parameter(torch.zeros_like(param, device=device)))
                done += param.numel() * param.element_size()
    return done


def local_bytes(model) -> dict[str, int]:
    """Bytes of this rank's parameters and buffers (DTensor: the local shard) against the whole model's."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        size = tensor.element_size()
        full += tensor.numel() * size
        local += (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel() * size
    return {"local": local, "full": full}


def materialize_shards(model, device: str, seed: int) -> dict[str, Any]:
    """Allocate this rank's shards of an FSDP2-sharded meta model on ``device`` and fill them at random.

    Returns the ``model_build`` fields: how, seconds, bytes materialized on this rank, bytes of the whole model,
    the dtypes held and the number of FSDP2 units.
    """
    import torch
    from torch.distributed.fsdp import FSDPModule

    started = time.perf_counter()
    base = flagged_model(model)
    model.to_empty(device=device)
    for module in base.modules():  # _from_config marked everything initialized (on meta): do it again
        module.__dict__.pop("_is_hf_initialized", None)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    base.initialize_weights()
    lora_layers = 0
    for module in model.modules():
        if hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A"):
            for adapter in module.lora_A:  # kaiming A, zero B: what PEFT did before the weights went to meta
                module.reset_lora_parameters(adapter, True)
                lora_layers += 1
    if device != "cpu":
        getattr(torch, device.split(":")[0]).synchronize()
    sizes = local_bytes(model)
    left_on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    return {
        "how": "built on the meta device, sharded by accelerate's fsdp2_prepare_model, then to_empty on "
        f"{device!r} (this rank's shards only) and transformers' initialize_weights + PEFT's "
        "reset_lora_parameters: random init, seed from the marker; replaces from_pretrained for this folder only",
        "seconds": round(time.perf_counter() - started, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes_materialized": sizes["local"],
        "bytes_full_model": sizes["full"],
        "fraction_of_full": round(sizes["local"] / sizes["full"], 4) if sizes["full"] else None,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "lora_layers_reset": lora_layers,
        "left_on_meta": left_on_meta[:5],
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
    }
