"""``fsdp2_frozen_dtype.trainable_units``: ``auto`` keeps each layer's LoRA in the layer's unit where torch allows a
unit to mix the bf16 base and the float32 LoRA parameters (2.8 on), else gives it a unit of its own; ``shared`` on an
older torch is refused before anything is wrapped. The two modes' sharded training on two gloo ranks is
``tests/run/test_fsdp2_cpu.py``."""

from __future__ import annotations

import pytest

from patches import fsdp2_frozen_dtype
from patches.errors import PatchError
from patches.proof import ProofFile


@pytest.mark.parametrize(("version", "auto"), [("2.7.1+cpu", "own"), ("2.7.1", "own"), ("2.8.0", "shared"),
                                               ("2.8.0a0+git1234", "shared"), ("2.11.0+cu130", "shared")])  # fmt: skip
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
    assert message.startswith("launcher.patches.fsdp2_frozen_dtype.trainable_units: shared needs torch >= 2.8; "
                              "torch 2.7.1 asserts")  # fmt: skip
    assert "set launcher.patches.fsdp2_frozen_dtype.trainable_units: auto" in message
    assert problems("shared", "fsdp2", "2.8.0") == problems("auto", "fsdp2", "2.7.1") == []
    assert problems("shared", "ddp", "2.7.1") == problems("shared", "fsdp2", None) == []  # None: another machine's
