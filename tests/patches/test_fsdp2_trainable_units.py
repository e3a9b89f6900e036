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


def test_shared_units_on_torch_2_7_are_refused_before_anything_is_wrapped(tmp_path, monkeypatch):
    import accelerate.accelerator
    import torch

    before = accelerate.accelerator.fsdp2_prepare_model
    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    options = {"enabled": True, "trainable_units": "shared", "embedding_units": True}
    with pytest.raises(PatchError, match=r"needs torch >= 2.8; torch 2.7.1\+cpu asserts") as raised:
        fsdp2_frozen_dtype.apply(options, backend="cpu", proof=ProofFile(tmp_path, "fsdp2_frozen_dtype", 0), facts={})
    assert "trainable_units: auto" in str(raised.value)
    assert accelerate.accelerator.fsdp2_prepare_model is before
