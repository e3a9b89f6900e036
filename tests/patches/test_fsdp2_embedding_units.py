"""``fsdp2_frozen_dtype``'s output-embedding unit: gathered once for every loss chunk, released before the decoder
layers' backward, and released at once after a call without gradients.

One gloo process (world size 1, an in-memory store) with torch's own ``fully_shard`` on CPU: with one rank a shard
is the whole tensor, but FSDP2 still swaps each parameter between its sharded form (a ``DTensor``) and a gathered
copy, which is what is observed here. The loss is the product's own ``chunked_causal_lm_loss``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from patches.chunked_loss import chunked_causal_lm_loss  # noqa: E402
from patches.fsdp2_frozen_dtype import _release_after_loss  # noqa: E402

HIDDEN, VOCAB, TOKENS = 16, 64, 24


@pytest.fixture()
def one_rank():
    if not dist.is_available():
        pytest.skip("torch.distributed is not built in")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _gathered(module) -> bool:
    from torch.distributed.tensor import DTensor

    return not isinstance(module.weight, DTensor)


def test_the_head_is_gathered_through_the_loss_chunks_and_released_before_the_layers_backward(one_rank):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    trunk = torch.nn.Linear(HIDDEN, HIDDEN)  # stands in for the decoder layers
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    fully_shard(head, mesh=one_rank, reshard_after_forward=False)
    _release_after_loss(head)

    seen = {}
    x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    hidden = trunk(x)

    def at_the_layers_backward(grad):
        seen["at_the_layers_backward"] = _gathered(head)

    hidden.register_hook(at_the_layers_backward)
    labels = torch.randint(0, VOCAB, (1, TOKENS))
    loss, _, chunks = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=5)
    assert chunks == 5
    assert _gathered(head), "the head is released between the loss's chunks"
    loss.backward()
    assert seen["at_the_layers_backward"] is False, "the head stayed gathered into the decoder layers' backward"
    assert not _gathered(head)
    assert trunk.weight.grad is not None and x.grad is not None

    # the same loss without FSDP2 and its hooks: the same value and gradients
    plain = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    with torch.no_grad():
        plain.weight.copy_(head.weight.full_tensor())
    x2 = x.detach().clone().requires_grad_(True)
    loss2, _, _ = chunked_causal_lm_loss(trunk(x2), labels, plain, chunk_tokens=5)
    loss2.backward()
    assert torch.allclose(loss, loss2) and torch.allclose(x.grad, x2.grad)

    # a second training step arms the release again
    x.grad = None
    loss, _, _ = chunked_causal_lm_loss(trunk(x), labels, head, chunk_tokens=5)
    assert _gathered(head)
    loss.backward()
    assert not _gathered(head)


def test_a_call_without_gradients_releases_the_head_at_once(one_rank):
    from torch.distributed.fsdp import fully_shard

    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    fully_shard(head, mesh=one_rank, reshard_after_forward=False)
    _release_after_loss(head)
    with torch.no_grad():
        logits = head(torch.randn(1, TOKENS, HIDDEN))
    assert logits.shape == (1, TOKENS, VOCAB)
    assert not _gathered(head)
