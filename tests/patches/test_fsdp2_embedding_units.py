"""``fsdp2_frozen_dtype``'s embedding units: the frozen input embedding gathered once per forward and not in the
backward; ``lm_head`` gathered once for every loss chunk, released before the decoder layers' backward, and once per
forward without gradients; tied or trained embeddings left in the root unit.

One gloo process (world size 1, an in-memory store) with torch's own ``fully_shard`` on CPU, a model shaped like the
product's (an input embedding whose output requires a gradient, as PEFT makes it; a trunk unit; ``lm_head``; the
whole model as the root unit, as accelerate makes it; the loss is the product's own ``chunked_causal_lm_loss``). With
one rank a shard is the whole tensor, but FSDP2 still swaps each parameter between its sharded form (a ``DTensor``)
and a gathered copy, which is what is observed; the gathers are counted on FSDP2's parameter groups (private
attributes of torch's FSDP2, read only here).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from patches import fsdp2_frozen_dtype  # noqa: E402
from patches.chunked_loss import chunked_causal_lm_loss  # noqa: E402

HIDDEN, VOCAB, TOKENS, CHUNK = 16, 64, 24, 5


class Tiny(torch.nn.Module):
    def __init__(self, *, tied: bool = False, trained: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.trunk = torch.nn.Linear(HIDDEN, HIDDEN)  # stands in for the decoder layers
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.embed.requires_grad_(trained)
        self.head.requires_grad_(trained)
        # PEFT's enable_input_require_grads, registered before any fully_shard
        self.embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
        self.seen: dict[str, bool] = {}

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids, labels):
        hidden = self.trunk(self.embed(ids))
        if hidden.requires_grad:
            hidden.register_hook(self._at_the_layers_backward)
        return chunked_causal_lm_loss(hidden, labels, self.head, CHUNK)[0]

    def _at_the_layers_backward(self, grad) -> None:
        self.seen["head_gathered_at_the_layers_backward"] = _gathered(self.head)


@pytest.fixture()
def mesh(monkeypatch):
    if not dist.is_available():
        pytest.skip("torch.distributed is not built in")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    made = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    monkeypatch.setattr(fsdp2_frozen_dtype, "_unit_kwargs", lambda accelerator: {"mesh": made})
    try:
        yield made
    finally:
        dist.destroy_process_group()


def _gathered(module) -> bool:
    from torch.distributed.tensor import DTensor

    return not isinstance(module.weight, DTensor)


def _count_gathers(module) -> dict[str, int]:
    """Count the all-gathers FSDP2 starts for ``module``'s unit (an ``unshard`` of a sharded group)."""
    counts = {"gathers": 0}
    for group in module._get_fsdp_state()._fsdp_param_groups:
        original = group.unshard

        def unshard(*args, _group=group, _original=original, **kwargs):
            sharded = _group._all_gather_result is None and not _group.is_unsharded
            result = _original(*args, **kwargs)
            counts["gathers"] += sharded and (_group._all_gather_result is not None or _group.is_unsharded)
            return result

        group.unshard = unshard
    return counts


def _shard(model: Tiny, mesh) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    made = fsdp2_frozen_dtype._embedding_units(None, model)
    fully_shard(model.trunk, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit, last, as accelerate makes it
    return made


def test_each_embedding_is_gathered_once_per_step_and_the_head_is_released_before_the_layers_backward(mesh):
    torch.manual_seed(0)
    model = Tiny()
    reference = Tiny()
    reference.load_state_dict(model.state_dict())
    assert _shard(model, mesh) == ["input", "output"]
    embed, head = _count_gathers(model.embed), _count_gathers(model.head)
    ids, labels = torch.randint(0, VOCAB, (1, TOKENS)), torch.randint(0, VOCAB, (1, TOKENS))

    for step in (1, 2):
        loss = model(ids, labels)
        assert _gathered(model.head), "the head is released between the loss's chunks"
        assert not _gathered(model.embed), "the input embedding stays gathered after its forward"
        loss.backward()
        assert model.seen.pop("head_gathered_at_the_layers_backward") is False
        assert not _gathered(model.head) and not _gathered(model.embed)
        assert (embed["gathers"], head["gathers"]) == (step, step), "one gather per step for each embedding"

    # the same loss and trunk gradient as the model without FSDP2 and its hooks
    reference_loss = reference(ids, labels)
    reference_loss.backward()
    assert torch.allclose(loss, reference_loss)
    assert torch.allclose(model.trunk.weight.grad.full_tensor() / 2, reference.trunk.weight.grad)  # two steps


def test_a_forward_without_gradients_gathers_the_head_once_and_releases_it(mesh):
    model = Tiny()
    _shard(model, mesh)
    head = _count_gathers(model.head)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, TOKENS)), torch.randint(0, VOCAB, (1, TOKENS)))
    assert head["gathers"] == 1, "one gather for all the loss's chunks"
    assert not _gathered(model.head)


@pytest.mark.parametrize(("tied", "trained"), [(True, False), (False, True)])
def test_tied_or_trained_embeddings_stay_in_the_root_unit(mesh, tied, trained):
    assert fsdp2_frozen_dtype._embedding_units(None, Tiny(tied=tied, trained=trained)) == []
