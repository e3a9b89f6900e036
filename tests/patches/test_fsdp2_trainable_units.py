"""``fsdp2_frozen_dtype.trainable_units``: ``auto`` keeps each layer's LoRA in the layer's unit where torch allows a
unit to mix the bf16 base and the float32 LoRA parameters (2.8 on), else gives it a unit of its own; ``shared`` on an
older torch is refused (by ``launcher check``, and in an FSDP2 rank before anything is wrapped). A unit that mixes
the bf16 base and the float32 LoRA is trained here on one gloo rank; the two modes' sharded training on two gloo
ranks (float32, so no mixing) is ``tests/run/test_fsdp2_cpu.py``."""

from __future__ import annotations

import pytest

from patches import fsdp2_frozen_dtype
from patches.core.errors import PatchError
from patches.core.proof import ProofFile


@pytest.mark.parametrize(
    ("version", "auto"),
    [
        ("2.7.1+cpu", "own"),
        ("2.7.1", "own"),
        ("2.8.0", "shared"),
        ("2.8.0a0+git1234", "shared"),
        ("2.11.0+cu130", "shared"),
    ],
)
def test_auto_takes_shared_units_from_torch_2_8_on(version, auto):
    assert fsdp2_frozen_dtype.trainable_units_mode("auto", version) == auto
    assert fsdp2_frozen_dtype.trainable_units_mode("own", version) == "own"


def test_shared_units_on_torch_2_7_are_refused_in_an_fsdp2_rank_before_anything_is_wrapped(tmp_path, monkeypatch):
    import accelerate.accelerator
    import torch

    before = accelerate.accelerator.fsdp2_prepare_model
    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    options = {"enabled": True, "trainable_units": "shared", "embedding_units": True}
    proof = ProofFile(tmp_path, "fsdp2_frozen_dtype", 0)
    try:  # a ddp rank builds no FSDP2 unit: nothing to refuse
        assert fsdp2_frozen_dtype.apply(options, backend="cpu", proof=proof, facts={})["trainable_units"] == "unused"
    finally:
        fsdp2_frozen_dtype.restore()
    assert accelerate.accelerator.fsdp2_prepare_model is before
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` sets in an FSDP2 rank
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(PatchError, match=r"needs torch >= 2.8; torch 2.7.1\+cpu asserts") as raised:
        fsdp2_frozen_dtype.apply(options, backend="cpu", proof=proof, facts={})
    assert "trainable_units: auto" in str(raised.value)
    assert accelerate.accelerator.fsdp2_prepare_model is before


def test_launcher_check_refuses_shared_units_on_an_older_torch_under_fsdp2_only():
    from launcher.checks.patch_check import patch_problems

    def problems(units, distribution, torch_version):
        patches = {"fsdp2_frozen_dtype": {"enabled": True, "trainable_units": units, "embedding_units": True}}
        return patch_problems(patches, {}, backend="npu", distribution=distribution, torch_version=torch_version)

    [(key, message)] = problems("shared", "fsdp2", "2.7.1")
    assert key == "launcher.patches.fsdp2_frozen_dtype.trainable_units"
    assert message.startswith(
        "launcher.patches.fsdp2_frozen_dtype.trainable_units: shared needs torch >= 2.8; torch 2.7.1 asserts"
    )
    assert "set launcher.patches.fsdp2_frozen_dtype.trainable_units: auto" in message
    assert problems("shared", "fsdp2", "2.8.0") == problems("auto", "fsdp2", "2.7.1") == []
    assert problems("shared", "ddp", "2.7.1") == problems("shared", "fsdp2", None) == []  # None: another machine's


def _lora_layer(seed: int):
    """A frozen bf16 projection with a float32 LoRA pair beside it, as PEFT leaves a layer after the patch's upcast."""
    import torch

    class LoraLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(16, 16, bias=False).to(torch.bfloat16).requires_grad_(False)
            self.lora_A = torch.nn.Linear(16, 4, bias=False)
            self.lora_B = torch.nn.Linear(4, 16, bias=False)

        def forward(self, x):
            return self.base(x) + self.lora_B(self.lora_A(x))

    torch.manual_seed(seed)
    return LoraLayer()


@pytest.mark.parametrize("units", ["own", "shared"])
def test_a_unit_holding_the_bf16_base_and_float32_lora_trains_as_separate_units_do(units):
    """The case ``shared`` exists for, on one gloo rank with torch's ``fully_shard`` on CPU (bf16 compute, float32
    gradient reduction: accelerate's policy for bf16 runs): a unit mixing the bf16 frozen weight and the float32 LoRA
    weights gives the LoRA float32 gradients equal to those of the same layer computed in bf16 without FSDP2, as the
    LoRA in a unit of its own (``own``) does."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    if fsdp2_frozen_dtype.trainable_units_mode("auto", torch.__version__) != "shared":
        pytest.skip("a unit may mix the two dtypes from torch 2.8 on")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    plain = _lora_layer(seed=0).to(torch.bfloat16)  # what the policy computes with, without FSDP2
    expected = torch.autograd.grad(plain(x).float().pow(2).mean(), [plain.lora_A.weight, plain.lora_B.weight])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        layer = _lora_layer(seed=0)
        if units == "own":
            fully_shard([layer.lora_A, layer.lora_B], mesh=mesh, mp_policy=policy)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        layer(x).float().pow(2).mean().backward()
        got = [
            p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for p in (layer.lora_A.weight, layer.lora_B.weight)
        ]
    finally:
        dist.destroy_process_group()
    assert layer.base.weight.dtype == torch.bfloat16 and layer.lora_A.weight.dtype == torch.float32
    for ours, reference in zip(got, expected, strict=True):
        assert ours.dtype == torch.float32 and float(reference.float().norm()) > 0
        torch.testing.assert_close(ours, reference.float(), rtol=0, atol=0)
