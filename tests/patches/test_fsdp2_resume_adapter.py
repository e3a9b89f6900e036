"""``fsdp2_resume_adapter``: the key mapping against PEFT's own file, and the restore on a real FSDP2 DTensor model.

The restore runs in this process as a one-rank gloo world (``fully_shard`` on a CPU mesh): every LoRA parameter is
a DTensor, as in a rank of a real run. What two ranks do (rank 1's slices set from rank 0's file) is shown by
``tests/run/test_fsdp2_cpu.py`` through ``launcher resume``.
"""

from __future__ import annotations

import pytest

from patches import fsdp2_resume_adapter as patch
from patches.core.errors import PatchError

pytest_plugins = ["tests.support.patch_fixtures"]


def _peft(make_tiny_model, use_dora: bool = False):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        make_tiny_model(),
        LoraConfig(r=4, lora_alpha=8, use_dora=use_dora, target_modules=["q_proj", "v_proj", "o_proj"]),
    )


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_every_trainable_parameter_maps_to_the_key_peft_writes(tmp_path, make_tiny_model, use_dora):
    from safetensors import safe_open

    model = _peft(make_tiny_model, use_dora)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / patch.ADAPTER_FILE), "pt") as handle:
        written = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    trainable = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    assert any(".default." in name for name in trainable)  # the adapter name is in the parameter names...
    mapping, problem, extra = patch.plan(trainable, written, "default")
    assert problem is None and extra == []
    assert set(mapping) == set(trainable) and set(mapping.values()) == set(written)  # ...and not in the file
    assert all(".default" not in key for key in written)


def test_a_parameter_without_an_entry_or_with_another_shape_is_named():
    trainable = {
        "base_model.model.x.q_proj.lora_A.default.weight": (4, 32),
        "base_model.model.x.q_proj.lora_B.default.weight": (32, 4),
        "base_model.model.x.scale": (3,),
    }
    stored = {"base_model.model.x.q_proj.lora_A.weight": (4, 32), "base_model.model.x.q_proj.lora_B.weight": (16, 4)}
    mapping, problem, _ = patch.plan(trainable, stored, "default")
    assert list(mapping) == ["base_model.model.x.q_proj.lora_A.default.weight"]
    assert "1 trainable parameter(s) have no entry: base_model.model.x.scale (looked for no key" in problem
    assert "1 shape(s) differ: base_model.model.x.q_proj.lora_B.default.weight: model [32, 4], file [16, 4]" in problem
    assert patch.plan({}, stored, "default")[1].startswith("the model has no trainable parameter")


@pytest.fixture
def one_rank_fsdp2(tmp_path, make_tiny_model):
    """A PEFT model sharded with FSDP2 in a one-rank gloo world (LoRA parameters are DTensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = _peft(make_tiny_model)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


def test_the_restore_sets_every_dtensor_shard_from_the_file_and_records_it(tmp_path, one_rank_fsdp2):
    import torch
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    model = one_rank_fsdp2
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(isinstance(p, DTensor) for p in lora.values())
    with torch.no_grad():
        for param in lora.values():
            param.to_local().normal_()
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()  # the whole adapter under PEFT's keys, as the Trainer's PEFT save writes it
    saved = {patch.file_key(name, "default"): param.full_tensor().clone() for name, param in lora.items()}
    save_file(saved, str(checkpoint / patch.ADAPTER_FILE))
    with torch.no_grad():  # what accelerate 1.11 leaves on ranks other than 0: initial values (B zero)
        for name, param in lora.items():
            param.to_local().zero_() if "lora_B" in name else param.to_local().uniform_()

    record = patch.restore_adapter(model, str(checkpoint))

    for name, param in lora.items():
        assert torch.equal(param.full_tensor(), saved[patch.file_key(name, "default")]), name
    assert record["tensors_set"] == len(lora) == record["file_tensors"] == record["changed_local_tensors"]
    assert record["local_before"]["lora_B"]["sq_norm"] == 0.0
    after = sum(kind["sq_norm"] for kind in record["local_after"].values())
    assert after == pytest.approx(record["file_sq_norm"], rel=1e-12) and after > 0
    assert record["checkpoint"] == str(checkpoint) and record["extra_file_key_count"] == 0


def test_a_checkpoint_whose_file_does_not_fit_stops_the_resume_with_the_fix(tmp_path, one_rank_fsdp2):
    import torch
    from safetensors.torch import save_file

    model = one_rank_fsdp2
    with pytest.raises(PatchError, match=r"adapter_model\.safetensors does not exist.*Fix: resume from a checkpoint"):
        patch.restore_adapter(model, str(tmp_path / "checkpoint-missing"))
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    save_file({"base_model.model.unrelated.weight": torch.zeros(2)}, str(checkpoint / patch.ADAPTER_FILE))
    with pytest.raises(PatchError) as info:
        patch.restore_adapter(model, str(checkpoint))
    message = str(info.value)
    assert "trainable parameter(s) have no entry: base_model.model.model.layers." in message
    assert "launcher.patches.fsdp2_resume_adapter: false" in message


@pytest.mark.usefixtures("restore_patches")
def test_the_switch_wraps_and_unwraps_the_trainers_load_and_the_guards_refuse_what_moved(tmp_path, monkeypatch):
    from transformers import Trainer, trainer

    import patches
    from patches.core import versions
    from patches.core.wrapping import MARKER, original_of

    upstream = original_of(trainer.load_fsdp_model)
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    assert getattr(trainer.load_fsdp_model, MARKER) == patch.NAME
    patches.apply_enabled({patch.NAME: False}, backend="cpu", proof_dir=tmp_path)
    assert trainer.load_fsdp_model is upstream
    assert patches.read_proof(tmp_path, patch.NAME)["status"] == "disabled"

    def _load_best_model(self):  # a Trainer that loads its best model another way
        return None

    monkeypatch.setattr(Trainer, "_load_best_model", _load_best_model)
    with pytest.raises(
        PatchError, match=r"_load_best_model \(transformers 5\.6\.\d+\) no longer reads load_fsdp_model"
    ):
        patch.check_symbols()
    monkeypatch.setattr(versions, "installed_version", lambda dist: "1.15.0" if dist == "accelerate" else "0")
    with pytest.raises(PatchError, match=r"accelerate 1\.15\.0 is installed; this patch supports accelerate<1\.15"):
        versions.check_versions(patch.NAME, {"accelerate": patch.SUPPORTED["accelerate"]})
