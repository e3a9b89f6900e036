"""``checkpoint_all_layers.offload_inputs`` on CPU: the offloader's data path, the option, and the patch around it.

On CPU there is no device memory to save: ``Offloader("cpu")`` copies each checkpointed input out into host chunks
and back into a new buffer, in the order and with the prefetch bookkeeping of the accelerators' path, so the tests
here drive the hooks, the chunking and the ordering. What they cannot run here: pinned memory, the side stream, its
events and the overlap of copies with compute (they need a CUDA or NPU device; the benchmark measures them).
The training through the real LLaMA-Factory path (loss and LoRA gradients to the bit, evaluation, stop and resume)
is tests/patches/test_offload_training.py.
"""

from __future__ import annotations

import pytest

import patches
from patches import checkpoint_all_layers
from patches.core.proof import read_proof
from patches.planning.census import StepObserver
from patches.planning.offload import OffloadedCheckpoint, Offloader

pytest_plugins = ["tests.support.patch_fixtures"]

NON_REENTRANT = "torch.utils.checkpoint.checkpoint(use_reentrant=False)"


def stack(layers: int = 4, width: int = 64):
    import torch

    torch.manual_seed(0)
    return [torch.nn.Linear(width, width) for _ in range(layers)]


def grads_through(lins, offloader: Offloader | None, tamper=None):
    """Gradients of a chain of checkpointed layers (non-reentrant), with the inputs offloaded or not; ``tamper``
    runs between the forward and the backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    for lin in lins:
        lin.zero_grad()
    x = torch.randn(300, lins[0].in_features, generator=torch.Generator().manual_seed(1)).requires_grad_(True)

    def plain(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False)

    func = OffloadedCheckpoint(plain, offloader) if offloader is not None else plain
    hidden = x * 1.5
    for lin in lins:
        hidden = func(lambda a, lin=lin: torch.tanh(lin(a)), hidden)
    if tamper is not None:
        tamper()
    hidden.square().sum().backward()
    return [lin.weight.grad.clone() for lin in lins] + [x.grad.clone()]


def test_offloaded_inputs_give_the_same_gradients_to_the_bit_and_are_fetched_ahead():
    import torch

    lins = stack()
    plain = grads_through(lins, None)
    offloader = Offloader("cpu", min_bytes=1024, chunk_bytes=4096)  # 300 x 64 x 4 bytes: 19 chunks an input
    moved = grads_through(lins, offloader)
    assert all(torch.equal(a, b) for a, b in zip(plain, moved, strict=True))
    # every layer's input went out; the last layer's came back on demand, each earlier one prefetched by the
    # unpack of the layer after it (the backward runs the layers in reverse)
    assert offloader.stats == {
        "packed": 4,
        "packed_bytes": 4 * 300 * 64 * 4,
        "left_alone": 0,
        "prefetched": 3,
        "fetched_on_demand": 1,
    }


def test_the_gradients_come_from_the_host_copies():
    """Changing the host copies between forward and backward changes the gradients: the backward reads them, not
    the device tensors (so the equality above is not the original tensors handed back)."""
    import torch

    lins = stack()
    plain = grads_through(lins, None)
    offloader = Offloader("cpu", min_bytes=1024, chunk_bytes=4096)

    def tamper():
        held = offloader._order[1]()
        held.chunks[0][:64] = 0  # the first 16 floats of the second layer's input

    moved = grads_through(lins, offloader, tamper=tamper)
    assert not torch.equal(plain[0], moved[0]) or not torch.equal(plain[1], moved[1])


def test_small_tensors_and_parameters_are_left_alone():
    import torch

    offloader = Offloader("cpu", min_bytes=1024)
    small = torch.zeros(8)
    param = torch.nn.Parameter(torch.zeros(1024))
    assert offloader.pack(small) is small and offloader.pack(param) is param
    assert offloader.unpack(small) is small
    assert offloader.stats["left_alone"] == 2 and offloader.stats["packed"] == 0


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_the_option_takes_true_false_and_auto(value):
    settings = patches.normalize_settings({"checkpoint_all_layers": {"offload_inputs": value}})
    assert settings["checkpoint_all_layers"]["offload_inputs"] == value


def test_the_option_defaults_to_auto_and_refuses_other_values_naming_the_key():
    assert patches.normalize_settings({})["checkpoint_all_layers"]["offload_inputs"] == "auto"
    with pytest.raises(ValueError) as err:
        patches.normalize_settings({"checkpoint_all_layers": {"offload_inputs": "yes"}})
    assert "launcher.patches.checkpoint_all_layers.offload_inputs" in str(err.value)
    with pytest.raises(ValueError, match="needs the patch enabled"):
        patches.normalize_settings({"checkpoint_all_layers": {"enabled": False, "offload_inputs": True}})


def test_auto_takes_the_launchers_decision_and_stays_off_without_one():
    decided = {"offload_inputs": {"on": True, "reason": "auto: 115.9 GiB without it"}}
    assert checkpoint_all_layers.offload_decision("auto", decided) == {
        "setting": "auto",
        "on": True,
        "reason": "auto: 115.9 GiB without it",
    }
    none = checkpoint_all_layers.offload_decision("auto", {})
    assert none["on"] is False and "no decision" in none["reason"]
    assert checkpoint_all_layers.offload_decision(False, decided)["on"] is False
    assert checkpoint_all_layers.offload_decision(True, {})["on"] is True


@pytest.mark.usefixtures("restore_patches")
@pytest.mark.parametrize("offload", [True, False])
def test_the_patch_offloads_every_checkpointed_layer_or_installs_nothing(
    tmp_path, make_tiny_model, stub_trainer, offload
):
    """On: every decoder layer still runs checkpointed non-reentrantly, inside the offloader, and the first step's
    record counts what moved. Off: the layers get torch's checkpoint itself, no hook around it."""
    import torch
    import transformers

    patches.apply_enabled(
        {"checkpoint_all_layers": {"offload_inputs": offload}}, backend="cpu", proof_dir=tmp_path / "proof"
    )
    model = make_tiny_model()
    observer = StepObserver(model)
    ids = torch.randint(1, 64, (2, 9))
    transformers.Trainer.training_step(stub_trainer, model, {"input_ids": ids, "labels": ids})  # the first step
    census = observer.finish()
    assert census["observed"] == {"non_reentrant": 2}
    funcs = {type(m._gradient_checkpointing_func) for m in model.model.layers}
    assert funcs == ({OffloadedCheckpoint} if offload else {type(checkpoint_all_layers.non_reentrant_checkpoint())})
    record = read_proof(tmp_path / "proof", "checkpoint_all_layers")
    assert record["offload_inputs"]["on"] is offload
    if offload:
        assert record["function"] == f"OffloadedCheckpoint -> {NON_REENTRANT}"
        assert record["offload_inputs"]["first_step"]["packed"] == 2  # one input per decoder layer
        assert record["offload_inputs"]["first_step"]["fetched_on_demand"] == 1
    else:
        assert record["function"] == NON_REENTRANT and "first_step" not in record["offload_inputs"]
