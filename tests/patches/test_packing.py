"""Packing on the hybrid model (CPU, fp32, the tiny demo model with real PEFT LoRA on q/k/v/o).

A packed row is built exactly as LLaMA-Factory 0.9.5's neat packing hands it to the model: samples laid end
to end, padding after them, the 2D mask numbering the samples turned into the 4D block-diagonal causal mask by
LLaMA-Factory's own ``prepare_4d_attention_mask``, and position ids restarting at 0 in every sample. Each
sample's loss and the LoRA gradients of the row must equal those of the samples run alone; the same test with a
planted leak (the convolution not reset, the chunk kernel run over the whole row) must fail. The slow test runs
``packing: true`` through ``launcher run`` and real LLaMA-Factory.
"""

from __future__ import annotations

import itertools

import pytest

import patches
from patches import packed_rows
from patches.core.proof import read_proof
from patches.packing import batches, deltanet, masks, varlen
from tests.support.patch_fixtures import grouped_varlen_kernel, lora_model

pytest_plugins = ["tests.support.patch_fixtures"]

LENGTHS = (11, 23, 17)  # three samples, then padding
ROW = 64
ON = {
    "deltanet_routing": True,
    "packed_rows": True,
    "checkpoint_all_layers": False,
    "chunked_loss": False,
    "text_only_batches": False,
    "final_eval_once": False,
}


def packing_model(model_dir):
    """The LoRA model as LLaMA-Factory trains it: ``use_cache`` off (``model_utils/kv_cache.py``)."""
    model = lora_model(model_dir, lora_b_std=0.05)
    model.config.use_cache = model.config.text_config.use_cache = False
    return model


def samples(vocab: int):
    """Three samples: ids, and labels with the first third masked as the prompt."""
    import torch

    torch.manual_seed(3)
    out = []
    for length in LENGTHS:
        ids = torch.randint(5, vocab, (length,))
        labels = ids.clone()
        labels[: length // 3] = -100
        out.append((ids, labels))
    return out


def packed_row(parts, only: int | None = None):
    """The row LLaMA-Factory's neat packing builds; ``only`` keeps the labels of one sample."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    ids = torch.zeros(1, ROW, dtype=torch.long)
    labels = torch.full((1, ROW), -100)
    numbered = torch.zeros(1, ROW, dtype=torch.long)
    position = torch.zeros(1, ROW, dtype=torch.long)
    at = 0
    for index, (sample_ids, sample_labels) in enumerate(parts):
        span = slice(at, at + len(sample_ids))
        ids[0, span], numbered[0, span] = sample_ids, index + 1
        position[0, span] = torch.arange(len(sample_ids))
        if only is None or only == index:
            labels[0, span] = sample_labels
        at += len(sample_ids)
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": prepare_4d_attention_mask(numbered, torch.float32),
        "position_ids": position[None].expand(4, 1, ROW).clone(),
    }


def alone(sample):
    ids, labels = sample
    return {"input_ids": ids[None], "labels": labels[None], "attention_mask": None}


def summed_loss(model, batch):
    """Sum of the token losses (the row's mean times its supervised tokens) and the LoRA gradients."""
    model.zero_grad()
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    loss = model(**batch).loss * tokens
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def compare(model, parts) -> tuple[float, float]:
    """(worst relative difference of the per-sample losses, of the LoRA gradients): packed vs alone."""
    import torch

    losses = []
    for index, sample in enumerate(parts):
        with torch.no_grad():
            packed = model(**packed_row(parts, only=index)).loss.item()
            single = model(**alone(sample)).loss.item()
        losses.append(abs(packed - single) / abs(single))
    total, grads = summed_loss(model, packed_row(parts))
    reference = {}
    for sample in parts:
        _, sample_grads = summed_loss(model, alone(sample))
        for name, grad in sample_grads.items():
            reference[name] = reference.get(name, 0) + grad
    worst = max(float((grads[n] - reference[n]).norm() / reference[n].norm()) for n in reference)
    return max(losses), worst


@pytest.mark.usefixtures("restore_patches")
def test_each_packed_sample_equals_the_sample_alone_and_so_do_the_lora_gradients(tmp_path, demo_assets):
    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path)  # before the model is built, as a run does
    model = packing_model(demo_assets["model"])
    parts = samples(model.config.text_config.vocab_size)
    loss_gap, grad_gap = compare(model, parts)
    assert loss_gap < 1e-4 and grad_gap < 1e-4, (loss_gap, grad_gap)
    print(f"packed vs alone: losses within {loss_gap:.1e}, LoRA gradients within {grad_gap:.1e} (relative)")
    first = read_proof(tmp_path, "packed_rows")["first_packed_call"]
    assert first["samples_per_row"] == [3] and first["row_length"] == ROW
    assert first["kernel_label"] == "torch" and first["mask"].endswith("(checked)")
    attention = read_proof(tmp_path, "packed_rows")["first_packed_attention"]
    assert attention["kernel"] == packed_rows.MASKED and attention["device"] == "cpu"  # fp32 on CPU: no varlen
    assert any("lora_A" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.usefixtures("restore_patches")
@pytest.mark.parametrize("count", [3, 1])
def test_with_the_fla_convolution_the_packed_row_hands_it_cu_seqlens(tmp_path, demo_assets, stub_fla, count):
    """The ``fused_ops`` route (backend cuda or npu) binds FLA's convolution; a packed row then passes its samples'
    bounds to that kernel instead of recomputing the first K-1 tokens, the padding joined to the last sample; a row
    of one sample is one sequence and goes without them. The stand-in FLA convolution (fla-core's contract in plain
    torch, on CPU) convolves each ``cu_seqlens`` span alone, the whole row without them."""
    from patches.kernels.fused_kernels import FlaConv

    stub_fla(platform="cuda")
    from fla.modules.causal_conv1d import CALLS, causal_conv1d

    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path)
    model = packing_model(demo_assets["model"])
    conv = FlaConv(causal_conv1d)
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    for layer in layers:
        layer.causal_conv1d_fn = conv  # what fused_ops binds at construction on an accelerator
    parts = samples(model.config.text_config.vocab_size)[:count]
    loss_gap, grad_gap = compare(model, parts)
    assert loss_gap < 1e-4 and grad_gap < 1e-4, (loss_gap, grad_gap)
    joined = [0, *itertools.accumulate(LENGTHS[: count - 1]), ROW]  # the last sample runs on through the padding
    assert CALLS["bounds"] == ([joined] * CALLS["varlen"] if count > 1 else [])
    assert CALLS["varlen"] >= (len(layers) if count > 1 else 0) and CALLS["n"] > CALLS["varlen"]
    first = read_proof(tmp_path, "packed_rows")["first_packed_call"]
    assert first["samples_per_row"] == [count] and first["conv_reset"] == (
        "cu_seqlens (FLA causal_conv1d)" if count > 1 else "none needed: one row of one sample (FLA causal_conv1d)"
    )


@pytest.mark.usefixtures("restore_patches")
@pytest.mark.parametrize("conv", ["torch", "fla"])
def test_unpacked_batches_on_the_fla_route_hand_the_kernel_their_key_heads_unrepeated(
    tmp_path, demo_assets, stub_fla, conv
):
    """An unpacked batch without a cache (one row; two rows, one padded on the right and one on the left, where
    transformers' zeroing of the padding matters) goes through ``packed_forward`` where the chunk kernel is FLA's:
    the kernel gets the tiny model's 2 key heads for its 4 value heads, and the loss, the LoRA gradients and the
    gradients of every DeltaNet weight (made trainable here, so that the backward through those layers is compared
    too) equal transformers' forward with ``unpacked_forward: false``, which hands the kernel the heads repeated. A
    forward with a cache goes to transformers' forward. FLA does not run on CPU: its chunk kernel is the grouped
    stand-in (fla-core 0.6's pairing over transformers' torch reference), its convolution the stand-in package's
    (``conv`` fla, counted) or transformers' torch convolution (``conv`` torch); the torch route is left alone."""
    import torch
    from transformers import DynamicCache

    from patches.kernels.fused_kernels import FlaConv
    from patches.kernels.recorder import CallLog, KernelRecorder

    stub_fla(platform="cuda")
    from fla.modules.causal_conv1d import causal_conv1d

    model = packing_model(demo_assets["model"])
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    assert not deltanet.unrepeated(layers[0])  # transformers' torch reference takes them repeated
    for layer in layers:
        layer.requires_grad_(True)
    heads: list[tuple[int, int, int]] = []
    fla = KernelRecorder(
        grouped_varlen_kernel(seen=heads),
        label="fla",
        expected_device="cpu",
        log=CallLog(lambda call: None),
        patch="test",
        backend="cpu",
    )
    fla_conv = FlaConv(causal_conv1d)
    torch.manual_seed(1)
    ids = torch.randint(3, model.config.text_config.vocab_size, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, 19:] = 0
    mask[1, :7] = 0  # left padding: the tokens after it read the padding's state unless it is zeroed
    labels = ids.masked_fill(mask == 0, -100)
    batches = (
        {"input_ids": ids[:1], "labels": labels[:1], "attention_mask": None},
        {"input_ids": ids, "labels": labels, "attention_mask": mask},
    )
    found = {}
    for on in (True, False):
        patches.apply_enabled(
            {**ON, "packed_rows": {"unpacked_forward": on}}, backend="cpu", proof_dir=tmp_path / str(on)
        )
        for layer in layers:
            layer.chunk_gated_delta_rule = fla
            if conv == "fla":
                layer.causal_conv1d_fn = fla_conv
        heads.clear()
        convolved = fla_conv.calls
        found[on] = [summed_loss(model, batch) for batch in batches]
        assert set(heads) == ({(2, 2, 4)} if on else {(4, 4, 4)})
        assert (fla_conv.calls > convolved) is (conv == "fla")
    for (loss, grads), (reference_loss, reference_grads) in zip(found[True], found[False], strict=True):
        assert loss == pytest.approx(reference_loss, rel=1e-5)
        assert any(".linear_attn." in name for name in reference_grads)
        for name, grad in reference_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)
    first = read_proof(tmp_path / "True", "packed_rows")["first_unpacked_call"]
    assert (first["rows"], first["length"], first["padding_zeroed"]) == (1, 24, False)
    assert (first["key_heads"], first["value_heads"], first["key_heads_repeated"]) == (2, 4, False)
    assert "first_unpacked_call" not in read_proof(tmp_path / "False", "packed_rows")
    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path / "cache")
    heads.clear()
    with torch.no_grad():
        model(input_ids=ids[:1], past_key_values=DynamicCache(config=model.config.text_config), use_cache=True)
    assert set(heads) == {(4, 4, 4)}


@pytest.mark.usefixtures("restore_patches")
def test_upstream_deltanet_leaks_state_across_packed_samples(tmp_path, demo_assets):
    """Without the patch the same comparison fails: the test above can fail."""
    patches.apply_enabled({**ON, "packed_rows": False}, backend="cpu", proof_dir=tmp_path)
    model = packing_model(demo_assets["model"])
    parts = samples(model.config.text_config.vocab_size)
    loss_gap, grad_gap = compare(model, parts)
    assert not (loss_gap < 1e-4 and grad_gap < 1e-4) and grad_gap > 5e-4, (loss_gap, grad_gap)


@pytest.mark.usefixtures("restore_patches")
@pytest.mark.parametrize("leak", ["conv_not_reset", "no_cu_seqlens"])
def test_a_planted_leak_fails_the_comparison(tmp_path, demo_assets, monkeypatch, leak):
    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path)  # before the model is built, as a run does
    model = packing_model(demo_assets["model"])
    parts = samples(model.config.text_config.vocab_size)

    def one_segment(found):
        rows = tuple((row, 0, found.length, True) for row in range(found.rows))
        return masks.Segments(found.rows, found.length, rows, found.position)

    name = "segment_causal_conv" if leak == "conv_not_reset" else "chunk_per_segment"
    real = getattr(deltanet, name)

    def leaking(*args):  # the same function, told that each row is one sequence
        return real(*args[:-1], one_segment(args[-1]))

    monkeypatch.setattr(deltanet, name, leaking)
    loss_gap, grad_gap = compare(model, parts)
    assert not (loss_gap < 1e-4 and grad_gap < 1e-4) and grad_gap > 5e-4, (leak, loss_gap, grad_gap)


@pytest.mark.usefixtures("restore_patches")
def test_a_packed_row_that_cannot_be_split_stops_the_run(tmp_path, demo_assets):
    """A mask shorter than the row (LLaMA-Factory's dummy image appended to a packed batch), a packed row with a
    cache, and a packing run whose first training batch reaches the model unpacked (before any layer runs it): each
    stops with the reason. A packed first batch, or an unpacked batch outside training, passes."""
    import torch
    from transformers import DynamicCache

    from patches.core.errors import PatchError

    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path, facts={"packing": True})
    model = packing_model(demo_assets["model"])
    row = packed_row(samples(model.config.text_config.vocab_size))
    unpacked = {**row, "attention_mask": torch.ones(1, ROW, dtype=torch.long), "labels": None}
    calls = packed_rows._state["calls"]
    with torch.no_grad():
        model.eval()
        model(**unpacked)  # not a training batch: nothing checked
        model.train()
        packed_rows._before_first_step(None, model)
        with pytest.raises(PatchError, match="first training batch reached the model unpacked"):
            model(**unpacked)
    assert packed_rows._state["calls"] == calls  # stopped before any DeltaNet layer ran the row
    assert read_proof(tmp_path, "packed_rows")["status"] == "failed"
    packed_rows._before_first_step(None, model)
    with torch.no_grad():
        model(**{**row, "labels": None})  # the first training batch packed: it runs
    assert packed_rows._state["calls"] > calls and packed_rows._state["batches"] == 1
    with torch.no_grad(), pytest.raises(PatchError, match="mask covers 64 positions but the row has 72 tokens"):
        model(
            **{
                **row,
                "input_ids": torch.nn.functional.pad(row["input_ids"], (0, 8)),
                "labels": None,
                "position_ids": torch.nn.functional.pad(row["position_ids"], (0, 8)),
            }
        )
    with torch.no_grad(), pytest.raises(PatchError, match="came with a cache"):
        model(**{**row, "labels": None}, past_key_values=DynamicCache(config=model.config.text_config), use_cache=True)


def attention_per_segment(query, key, value, found, scaling=None):
    """``[B, H, T, D]`` to ``[B, T, H, D]``: causal SDPA over every segment alone, which is what a varlen kernel
    computes; key heads shared by groups of query heads."""
    import torch
    import torch.nn.functional as F

    rows, heads, length, _ = query.shape
    out = torch.zeros(rows, length, heads, value.shape[-1], dtype=query.dtype, device=query.device)
    for row, start, end, _ in found.spans:
        part = F.scaled_dot_product_attention(
            query[row : row + 1, :, start:end],
            key[row : row + 1, :, start:end],
            value[row : row + 1, :, start:end],
            is_causal=True,
            scale=scaling,
            enable_gqa=True,
        )
        out[row, start:end] = part[0].transpose(0, 1)
    return out


def flash_stand_in(seen: list):
    """A stand-in for ``aten._flash_attention_forward`` (it runs only on CUDA) that checks the call as the product
    makes it (``cu_seqlens`` int32, the same for queries and keys, the longest segment, no dropout, causal) and
    computes causal SDPA over every segment alone, FlashAttention's definition, key heads shared; each call's bounds,
    scale and head counts go to ``seen``."""
    import torch

    def flash(query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale):
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and (dropout_p, is_causal, debug) == (0.0, True, False)
        bounds = cu_q.tolist()
        assert max_q == max_k == max(e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True))
        seen.append({"bounds": bounds, "scale": scale, "heads": (query.shape[1], key.shape[1], value.shape[1])})
        out = torch.empty_like(query)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            part = torch.nn.functional.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1)[None] for t in (query, key, value)),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = part[0].transpose(0, 1)
        return out, None, None, None, None

    return flash


@pytest.mark.usefixtures("restore_patches")
def test_packed_attention_through_a_varlen_kernel_keeps_samples_apart_and_its_check_catches_a_leak(
    tmp_path, demo_assets, monkeypatch
):
    """The attention layers' varlen route, end to end on the tiny model: the product's ``varlen_attention`` with a
    stand-in FlashAttention operator (FlashAttention and ``npu_fusion_attention`` do not run on CPU; the stand-in is
    causal SDPA per segment, their definition) and the row's padding cut into pieces (``PADDING_PIECE`` lowered to
    the tiny row's scale): the packed row still equals its samples alone, loss and LoRA gradients, and the first
    call's check against the block mask is recorded. A kernel that lets samples see each other (causal over the whole
    row) stops the run at that check."""
    from patches.core.errors import PatchError

    seen = []
    monkeypatch.setattr(varlen, "aten_flash_op", lambda: flash_stand_in(seen))
    monkeypatch.setattr(varlen, "varlen_kernel", lambda query, scaling, dropout: varlen.ATEN_FLASH)
    monkeypatch.setattr(varlen, "PADDING_PIECE", 4)
    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path)
    model = packing_model(demo_assets["model"])
    parts = samples(model.config.text_config.vocab_size)
    loss_gap, grad_gap = compare(model, parts)
    assert loss_gap < 1e-4 and grad_gap < 1e-4, (loss_gap, grad_gap)
    attention = read_proof(tmp_path, "packed_rows")["first_packed_attention"]
    assert attention["kernel"] == varlen.ATEN_FLASH and attention["checked_against"] == packed_rows.MASKED
    assert attention["relative_l2_difference"] < 1e-5
    padding = ROW - sum(LENGTHS)
    assert padding > 4 and any(len(call["bounds"]) == len(LENGTHS) + 1 + -(-padding // 4) for call in seen), seen

    def leaking(kernel, query, key, value, found, scaling):
        whole = masks.Segments(
            found.rows, found.length, tuple((r, 0, found.length, True) for r in range(found.rows)), found.position
        )
        return attention_per_segment(query, key, value, whole, scaling)

    packed_rows.restore()
    monkeypatch.setattr(varlen, "varlen_attention", leaking)
    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path / "leak")
    import torch

    with torch.no_grad():  # one sample and padding: a leak cannot show, and the check says which row it saw
        model(**packed_row(parts[:1]))
    single = read_proof(tmp_path / "leak", "packed_rows")["first_packed_attention"]
    assert single["samples_per_row"] == [1] and single["relative_l2_difference"] < 1e-5
    with torch.no_grad(), pytest.raises(PatchError, match="disagrees with SDPA under the block mask"):
        model(**packed_row(parts))  # the first row of several samples is checked too
    record = read_proof(tmp_path / "leak", "packed_rows")
    assert record["status"] == "failed" and record["first_multi_sample_attention"]["samples_per_row"] == [3]


@pytest.mark.usefixtures("restore_patches")
@pytest.mark.parametrize("first", ["one sample", "two samples"])
def test_a_row_of_one_sample_takes_causal_sdpa_over_the_row_where_sdpa_would_use_cudnn(
    tmp_path, demo_assets, monkeypatch, first
):
    """On the CUDA route (stood in: FlashAttention and cuDNN do not run on CPU, so the varlen operator and SDPA's
    backend choice are stand-ins) a batch of one row holding one sample, its padding after it, goes to SDPA causal
    over the whole row without the mask, as the unpacked step does, where SDPA would pick cuDNN: the varlen operator
    is not called, SDPA gets no mask, is causal and shares the key heads, the sample's loss and the LoRA gradients
    equal the sample run alone, and its first call is checked against the block mask, whether or not a row of
    several samples came first. A row of two samples, a row whose padding comes first (a segment of its own), and
    any row where SDPA would pick FlashAttention still take the operator."""
    import torch
    import torch.nn.functional as F
    from llamafactory.data.collator import prepare_4d_attention_mask

    seen, sdpa_calls, backend = [], [], {"cudnn": True}
    sdpa = F.scaled_dot_product_attention

    def spied(query, key, value, attn_mask=None, **kwargs):
        sdpa_calls.append((attn_mask is None, kwargs.get("is_causal"), kwargs.get("enable_gqa")))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spied)
    monkeypatch.setattr(varlen, "aten_flash_op", lambda: flash_stand_in(seen))
    monkeypatch.setattr(varlen, "varlen_kernel", lambda query, scaling, dropout: varlen.ATEN_FLASH)
    monkeypatch.setattr(packed_rows, "sdpa_uses_cudnn", lambda query, key, value, scaling: backend["cudnn"])
    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path)
    model = packing_model(demo_assets["model"])
    layers = len([m for m in model.modules() if type(m).__name__ == "Qwen3_5Attention"])
    parts = samples(model.config.text_config.vocab_size)
    if first == "two samples":
        with torch.no_grad():
            model(**packed_row(parts[:2]))
        assert len(seen) == layers
        seen.clear()
    sdpa_calls.clear()
    with torch.no_grad():
        model(**packed_row(parts[:1]))
    # every layer without a mask, causal, key heads shared; once more with the mask: the first call's reference
    assert seen == [] and sorted(sdpa_calls) == sorted([(True, True, True)] * layers + [(False, False, None)])
    loss_gap, grad_gap = compare(model, parts[:1])
    assert loss_gap < 1e-4 and grad_gap < 1e-4, (loss_gap, grad_gap)
    assert seen == []
    proof = read_proof(tmp_path, "packed_rows")
    attention = proof["first_packed_attention" if first == "one sample" else "first_one_sample_attention"]
    assert attention["kernel"] == packed_rows.ONE_SAMPLE and attention["samples_per_row"] == [1]
    assert attention["checked_against"] == packed_rows.MASKED and attention["relative_l2_difference"] < 1e-5
    ids = packed_row(parts[:1])["input_ids"].roll(8, dims=1)
    padded_first = prepare_4d_attention_mask(
        torch.tensor([[0] * 8 + [1] * LENGTHS[0] + [0] * (ROW - 8 - LENGTHS[0])]), torch.float32
    )
    with torch.no_grad():
        model(input_ids=ids, attention_mask=padded_first)
    assert len(seen) == layers
    backend["cudnn"] = False  # FlashAttention 2, say: the varlen call on the sample and its padding is cheaper
    with torch.no_grad():
        model(**packed_row(parts[:1]))
    assert len(seen) == 2 * layers


def test_sdpa_is_asked_once_per_shape_whether_it_would_use_cudnn_and_no_answer_is_no(monkeypatch):
    """``sdpa_uses_cudnn`` asks ``torch._fused_sdp_choice`` for the unpacked step's call (causal, no mask, key heads
    shared) once per shape and compares its answer with torch's ``SDPBackend.CUDNN_ATTENTION``; another backend, or
    a torch whose function takes other arguments, is a no (no shortcut)."""
    import torch
    from torch.nn.attention import SDPBackend

    packed_rows._cache.clear()
    asked, answer = [], {"backend": SDPBackend.CUDNN_ATTENTION}

    def choice(query, key, value, mask, dropout, causal, scale=None, enable_gqa=False):
        asked.append((mask, dropout, causal, scale, enable_gqa))
        return answer["backend"].value

    monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
    q, k = torch.zeros(1, 4, 16, 8), torch.zeros(1, 2, 16, 8)
    assert packed_rows.sdpa_uses_cudnn(q, k, k, 0.5) and packed_rows.sdpa_uses_cudnn(q, k, k, 0.5)
    assert asked == [(None, 0.0, True, 0.5, True)]
    answer["backend"] = SDPBackend.FLASH_ATTENTION
    assert not packed_rows.sdpa_uses_cudnn(torch.zeros(1, 4, 24, 8), k, k, 0.5)

    def older(query, key, value, mask, dropout, causal, scale=None):
        raise AssertionError("not reached: the keyword is refused first")

    monkeypatch.setattr(torch, "_fused_sdp_choice", older)
    assert not packed_rows.sdpa_uses_cudnn(torch.zeros(1, 4, 32, 8), k, k, None)
    packed_rows._cache.clear()


def test_the_cuda_attention_route_is_varlen_from_compute_capability_8_in_half_precision_without_dropout(monkeypatch):
    """No GPU here: the device's capability and the operators' presence are stand-ins, the choice is the product's.
    FlashAttention's varlen through torch's operator, which shares key heads, on any torch that has it with the
    expected arguments; ``varlen_attn`` where it has not; no varlen kernel below compute capability 8, in fp32,
    with dropout, or where torch has neither."""
    import types

    import torch

    query = types.SimpleNamespace(dtype=torch.bfloat16, device=types.SimpleNamespace(type="cuda"), shape=(1, 6, 32, 8))
    capability = {"major": 9}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (capability["major"], 0))
    monkeypatch.setattr(
        varlen, "torch_varlen_options", lambda: {"causal": {"is_causal": True}, "scale": True, "gqa": False}
    )
    monkeypatch.setattr(varlen, "aten_flash_op", lambda: "the operator")
    assert varlen.varlen_kernel(query, None, 0.0) == varlen.ATEN_FLASH  # varlen_attn would repeat key heads
    assert varlen.varlen_kernel(query, None, 0.1) is None
    gqa = {"causal": {"window_size": (-1, 0)}, "scale": True, "gqa": True}
    monkeypatch.setattr(varlen, "torch_varlen_options", lambda: gqa)
    assert varlen.varlen_kernel(query, 0.5, 0.0) == varlen.ATEN_FLASH  # varlen_attn wraps the same call
    monkeypatch.setattr(varlen, "aten_flash_op", lambda: None)  # a torch whose operator changed its arguments
    assert varlen.varlen_kernel(query, 0.5, 0.0) == varlen.TORCH_VARLEN
    monkeypatch.setattr(varlen, "torch_varlen_options", lambda: {**gqa, "gqa": False})
    assert varlen.varlen_kernel(query, 0.5, 0.0) == varlen.TORCH_VARLEN
    monkeypatch.setattr(varlen, "aten_flash_op", lambda: "the operator")
    fp32 = types.SimpleNamespace(**{**vars(query), "dtype": torch.float32})
    assert varlen.varlen_kernel(fp32, None, 0.0) is None
    # a torch without varlen_attn (before 2.10, as in the images), or one whose varlen_attn takes no scale when the
    # layer has its own: the FlashAttention operator itself; neither: the mask
    monkeypatch.setattr(varlen, "torch_varlen_options", lambda: None)
    assert varlen.varlen_kernel(query, None, 0.0) == varlen.ATEN_FLASH
    monkeypatch.setattr(
        varlen, "torch_varlen_options", lambda: {"causal": {"is_causal": True}, "scale": False, "gqa": False}
    )
    assert varlen.varlen_kernel(query, 0.5, 0.0) == varlen.ATEN_FLASH
    monkeypatch.setattr(varlen, "aten_flash_op", lambda: None)
    assert varlen.varlen_kernel(query, 0.5, 0.0) is None
    capability["major"] = 7
    assert varlen.varlen_kernel(query, None, 0.0) is None


@pytest.mark.usefixtures("restore_patches")
@pytest.mark.parametrize("collated_here", [True, False])
def test_sample_numbers_from_the_collator_become_the_block_mask_on_the_device(tmp_path, demo_assets, collated_here):
    """With ``device_mask`` the collator hands the model LLaMA-Factory's 2D sample numbers as int32 (its 4D step
    skipped: the slow launcher test below runs the real collator); the text model builds the same 4D mask from them,
    in the collator's dtype or, in a process that collated nothing (a DataLoader worker collated), the embeddings',
    and the DeltaNet layers take the samples read off the numbers. Loss and LoRA gradients equal those of the row
    with LLaMA-Factory's own 4D mask, exactly. With ``device_mask: false`` the numbers reach transformers as they
    are (a padding mask: not packed)."""
    import torch

    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path)
    if collated_here:
        packed_rows._state["mask_dtype"] = torch.float32  # what the wrapped collator records with a batch
    model = packing_model(demo_assets["model"])
    parts = samples(model.config.text_config.vocab_size)
    row = packed_row(parts)
    numbered = torch.zeros(1, ROW, dtype=torch.int32)
    at = 0
    for index, (ids, _) in enumerate(parts):
        numbered[0, at : at + len(ids)] = index + 1
        at += len(ids)
    loss_4d, grads_4d = summed_loss(model, row)
    calls = packed_rows._state["calls"]
    loss_numbers, grads_numbers = summed_loss(model, {**row, "attention_mask": numbered})
    assert packed_rows._state["calls"] > calls and packed_rows._state["batches"] == 2  # the 4D row, then these
    first = read_proof(tmp_path, "packed_rows")["first_packed_batch"]
    assert first["samples_per_row"] == [3] and first["mask"].startswith("4D")
    assert loss_numbers == loss_4d
    for name, grad in grads_4d.items():
        torch.testing.assert_close(grads_numbers[name], grad, rtol=0, atol=0)
    packed_rows._state["device_mask"] = False
    calls = packed_rows._state["calls"]
    with torch.no_grad():
        model(**{**row, "attention_mask": numbered})
    assert packed_rows._state["calls"] == calls


@pytest.mark.usefixtures("restore_patches")
def test_the_first_step_takes_the_mask_dtype_from_the_trainers_collator_when_workers_collated(tmp_path):
    """With DataLoader workers this process's collator never ran, so the first step reads LLaMA-Factory's
    ``compute_dtype`` off the Trainer's collator; a dtype this process's collator recorded is kept."""
    import types

    import torch

    trainer = types.SimpleNamespace(data_collator=types.SimpleNamespace(compute_dtype=torch.bfloat16))
    patches.apply_enabled(ON, backend="cpu", proof_dir=tmp_path, facts={"packing": True})
    packed_rows._before_first_step(trainer, None)
    assert packed_rows._state["mask_dtype"] == torch.bfloat16
    packed_rows._state["mask_dtype"] = torch.float16
    packed_rows._before_first_step(trainer, None)
    assert packed_rows._state["mask_dtype"] == torch.float16


@pytest.mark.usefixtures("restore_patches")
def test_the_collator_keeps_the_sample_numbers_and_restores_its_own_setting(tmp_path):
    """The collator wrapper around a stand-in for LLaMA-Factory's ``SFTDataCollatorWith4DAttentionMask.__call__``
    (its 4D step as 0.9.5 writes it, on ``block_diag_attn``; the real collator runs in the slow launcher test):
    with ``device_mask`` two padded rows arrive as int32 numbers and ``block_diag_attn`` is what it was, also when
    the collator raises; with ``device_mask: false`` the 4D mask. The wrapper counts and records nothing (it may run
    in a DataLoader worker): the text model does, where it meets the batch (the sample-numbers test above)."""
    import types

    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    numbered = torch.tensor([[1] * 5 + [2] * 3 + [0] * 2, [1] * 10])
    position = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0], list(range(10))])

    def collate(self, features):  # LLaMA-Factory 0.9.5: numbers, then the 4D step unless flash_attention_2
        if features == "fail":
            raise ValueError("a broken batch")
        batch = {
            "input_ids": torch.ones(2, 10, dtype=torch.long),
            "attention_mask": numbered.clone(),
            "position_ids": position,
        }
        if self.block_diag_attn and self.attn_implementation != "flash_attention_2":
            batch["attention_mask"] = prepare_4d_attention_mask(batch["attention_mask"], self.compute_dtype)
        return batch

    wrapped = packed_rows._make_collate(collate)
    collator = types.SimpleNamespace(block_diag_attn=True, attn_implementation="sdpa", compute_dtype=torch.bfloat16)
    for device_mask in (True, False):
        patches.apply_enabled(
            {**ON, "packed_rows": {"device_mask": device_mask}}, backend="cpu", proof_dir=tmp_path / str(device_mask)
        )
        batch = wrapped(collator, [])
        mask = batch["attention_mask"]
        if device_mask:
            assert mask.dtype == torch.int32 and torch.equal(mask, numbered.int())
            assert packed_rows._state["mask_dtype"] == torch.bfloat16
        else:
            assert torch.equal(mask, prepare_4d_attention_mask(numbered, torch.bfloat16))
        assert collator.block_diag_attn is True and packed_rows._state["batches"] == 0
        assert "first_packed_batch" not in read_proof(tmp_path / str(device_mask), "packed_rows")
        with pytest.raises(ValueError, match="a broken batch"):
            wrapped(collator, "fail")
        assert collator.block_diag_attn is True
        packed_rows.restore()


@pytest.mark.usefixtures("restore_patches")
def test_a_packed_row_cut_after_its_last_sample_trains_as_the_whole_row(tmp_path, demo_assets):
    """``cut_padding``: the row of three samples (51 tokens, padded to 64) cut to 56 tokens (a multiple of 8) gives
    the loss and the LoRA gradients of the whole row; the cut row is what the model meets (its proof says so)."""
    import torch

    patches.apply_enabled({**ON, "packed_rows": {"cut_padding": 8}}, backend="cpu", proof_dir=tmp_path)
    packed_rows._state["mask_dtype"] = torch.float32
    model = packing_model(demo_assets["model"])
    parts = samples(model.config.text_config.vocab_size)
    numbered = torch.zeros(1, ROW, dtype=torch.int32)
    at = 0
    for index, (ids, _) in enumerate(parts):
        numbered[0, at : at + len(ids)] = index + 1
        at += len(ids)
    whole = {**packed_row(parts), "attention_mask": numbered}
    cut = batches.cut_padding(dict(whole), masks.numbered_segments(numbered), 8)
    assert {name: tuple(value.shape) for name, value in cut.items()} == {
        "input_ids": (1, 56),
        "labels": (1, 56),
        "attention_mask": (1, 56),
        "position_ids": (4, 1, 56),
    }
    loss_cut, grads_cut = summed_loss(model, cut)
    first = read_proof(tmp_path, "packed_rows")["first_packed_batch"]
    assert first["row_length"] == 56 and first["padding_tokens"] == 56 - sum(LENGTHS) and first["cut_padding"] == 8
    loss_whole, grads_whole = summed_loss(model, whole)
    assert abs(loss_cut - loss_whole) <= 1e-5 * abs(loss_whole)
    for name, grad in grads_whole.items():
        torch.testing.assert_close(grads_cut[name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("multiple", "length"), [(4, 8), (8, 8), (3, 9), (16, 10), (0, 10)])
def test_the_padding_is_cut_after_the_fullest_rows_last_sample_token_rounded_up(multiple, length):
    """Two rows of 10 (samples end at 6 and at 8: the fullest is the second): cut to the multiple at or above 8, never
    longer than the rows; the 4D mask in both of its last dimensions, the very entries of the whole mask; 0 keeps the
    rows whole; what is not a per-token tensor is left as it is."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    numbered = torch.tensor([[1] * 6 + [0] * 4, [1] * 5 + [2] * 3 + [0] * 2])
    for mask in (numbered, prepare_4d_attention_mask(numbered, torch.float32)):
        batch = {
            "input_ids": torch.arange(20).view(2, 10),
            "labels": torch.full((2, 10), -100),
            "steps": 7,
            "attention_mask": mask,
            "position_ids": torch.zeros(3, 2, 10, dtype=torch.long),
            "rope_deltas": torch.zeros(2, 1),
            "scalar": torch.tensor(10),
        }
        found = masks.numbered_segments(numbered)
        out = batches.cut_padding(batch, found, multiple)
        assert out["input_ids"].shape == (2, length) and out["position_ids"].shape == (3, 2, length)
        assert torch.equal(out["input_ids"], torch.arange(20).view(2, 10)[:, :length])
        assert torch.equal(
            out["attention_mask"], mask[..., :length] if mask.dim() == 2 else mask[..., :length, :length]
        )
        assert out["steps"] == 7 and out["rope_deltas"].shape == (2, 1) and int(out["scalar"]) == 10


@pytest.mark.parametrize("other", ["a per-token tensor it does not know", "a target after the cut"])
def test_a_batch_the_cut_could_change_is_left_whole_and_the_proof_says_so(tmp_path, other):
    """A per-token tensor the cut does not know (say, a future collator's key), or a label after the cut that is not
    -100 (``ignore_pad_token_for_loss: false``: the collator's padding is a target), keeps the whole batch; the
    model's first packed batch records ``left_whole``."""
    import torch

    numbered = torch.tensor([[1] * 4 + [0] * 6])
    batch = {
        "input_ids": torch.ones(1, 10, dtype=torch.long),
        "attention_mask": numbered,
        "labels": torch.full((1, 10), -100),
    }
    if other.startswith("a per-token"):
        batch["unknown"] = torch.ones(1, 10)
    else:
        batch["labels"][0, 9] = 0
    found = masks.numbered_segments(numbered)
    out = batches.cut_padding(batch, found, 4)
    assert out["input_ids"].shape == (1, 10) and out["labels"].shape == (1, 10)
    patches.apply_enabled({**ON, "packed_rows": {"cut_padding": 4}}, backend="cpu", proof_dir=tmp_path)
    try:
        packed_rows._record_batch(found, True)
        assert read_proof(tmp_path, "packed_rows")["first_packed_batch"]["left_whole"] is True
    finally:
        packed_rows.restore()


@pytest.mark.usefixtures("restore_patches")
def test_the_collator_wrapper_cuts_the_packed_batch_it_hands_over(tmp_path):
    """The wrapper around a stand-in for LLaMA-Factory's collator (the slow launcher test runs the real one): with
    ``cut_padding: 4`` two rows of 10 whose fullest row ends at 7 come out 8 long, position ids included; with 0
    whole."""
    import types

    import torch

    numbered = torch.tensor([[1] * 3 + [0] * 7, [1] * 4 + [2] * 3 + [0] * 3])
    position = torch.tensor([[0, 1, 2] + [0] * 7, [0, 1, 2, 3, 0, 1, 2, 0, 0, 0]])

    def collate(self, features):
        positions = position[None].expand(4, 2, 10).clone()
        return {
            "input_ids": torch.ones(2, 10, dtype=torch.long),
            "attention_mask": numbered.clone(),
            "labels": torch.full((2, 10), -100),
            "position_ids": positions,
        }

    wrapped = packed_rows._make_collate(collate)
    collator = types.SimpleNamespace(block_diag_attn=True, attn_implementation="sdpa", compute_dtype=torch.float32)
    for multiple, length in ((4, 8), (0, 10)):
        patches.apply_enabled(
            {**ON, "packed_rows": {"cut_padding": multiple}}, backend="cpu", proof_dir=tmp_path / str(multiple)
        )
        batch = wrapped(collator, [])
        assert {name: value.shape[-1] for name, value in batch.items()} == dict.fromkeys(batch, length)
        assert torch.equal(batch["position_ids"][0], position[:, :length])
        packed_rows.restore()


@pytest.mark.parametrize("release", ["2.10", "2.11"])
def test_the_torch_varlen_call_fits_each_releases_arguments(monkeypatch, release):
    """torch's ``varlen_attn`` runs only on CUDA: a stand-in with the signature of torch 2.10 (``is_causal``) or
    2.11 (``window_size``, ``scale``; neither has ``enable_gqa``) checks how it is called and computes causal
    attention per ``cu_seq_q`` segment, which is its definition; key heads arrive repeated for the query heads."""
    import torch
    import torch.nn.attention.varlen as torch_varlen
    from llamafactory.data.collator import prepare_4d_attention_mask

    seen = {}

    def per_segment(query, key, value, cu, longest, causal, scale):
        assert causal and cu.dtype == torch.int32 and key.shape[1] == query.shape[1] == 6
        bounds = cu.tolist()
        assert longest == max(e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True))
        out = torch.empty_like(query)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            part = torch.nn.functional.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1)[None] for t in (query, key, value)), is_causal=True, scale=scale
            )
            out[start:end] = part[0].transpose(0, 1)
        seen.update(bounds=bounds, scale=scale)
        return out

    if release == "2.10":

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return per_segment(query, key, value, cu_seq_q, max_q, is_causal, None)
    else:

        def varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
        ):
            return per_segment(query, key, value, cu_seq_q, max_q, window_size == (-1, 0), scale)

    monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn)
    varlen.torch_varlen_options.cache_clear()
    try:
        options = varlen.torch_varlen_options()
        assert options["gqa"] is False and options["scale"] is (release == "2.11")
        torch.manual_seed(0)
        numbered = torch.tensor([[1] * 9 + [2] * 20 + [0] * 3, [1] * 16 + [2] * 16])
        found = masks.segments(prepare_4d_attention_mask(numbered, torch.float32))
        query, key, value = torch.randn(2, 6, 32, 8), torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
        ours = varlen.varlen_attention(varlen.TORCH_VARLEN, query, key, value, found, 8**-0.5)
        assert seen["bounds"] == [0, 9, 29, 32, 48, 64]
        expected = attention_per_segment(query, key, value, found, 8**-0.5)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    finally:
        varlen.torch_varlen_options.cache_clear()


def test_the_flash_operator_is_called_with_cumulative_lengths_and_the_key_heads_unrepeated(monkeypatch):
    """``aten._flash_attention_forward`` runs only on CUDA: a stand-in with its leading arguments checks the call
    (rows end to end, ``cu_seqlens`` int32 for queries and keys, the longest sample, no dropout, causal, the layer's
    scale; two key heads for six query heads, as FlashAttention shares them) and computes causal attention per
    segment, its definition. The real operator's argument names are what ``aten_flash_op`` requires."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    uncached = varlen.aten_flash_op.__wrapped__
    if torch.backends.cuda.is_flash_attention_available():  # a CUDA build: its operator has the arguments, in order
        assert uncached() is not None
    seen = []
    monkeypatch.setattr(varlen, "aten_flash_op", lambda: flash_stand_in(seen))
    torch.manual_seed(0)
    numbered = torch.tensor([[1] * 9 + [2] * 20 + [0] * 3, [1] * 16 + [2] * 16])
    found = masks.segments(prepare_4d_attention_mask(numbered, torch.float32))
    query, key, value = torch.randn(2, 6, 32, 8), torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    ours = varlen.varlen_attention(varlen.ATEN_FLASH, query, key, value, found, 0.3)
    assert seen == [{"bounds": [0, 9, 29, 32, 48, 64], "scale": 0.3, "heads": (6, 2, 2)}]  # key heads unrepeated
    torch.testing.assert_close(ours, attention_per_segment(query, key, value, found, 0.3), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert uncached() is None  # a torch built without FlashAttention: the mask


def test_the_padding_reaches_the_varlen_kernel_in_pieces_and_leaves_the_samples_unchanged(monkeypatch):
    """A row's padding goes to the varlen attention kernels as segments of at most ``PADDING_PIECE`` tokens (one
    causal segment of P padding tokens costs like a sample of P); the samples' boundaries, the DeltaNet layers'
    ``cu_seqlens`` and every sample token's output stay as they were. The stand-in operator is causal SDPA per
    segment (FlashAttention's definition; it runs only on CUDA)."""
    import torch

    piece = varlen.PADDING_PIECE
    seen = []
    monkeypatch.setattr(varlen, "aten_flash_op", lambda: flash_stand_in(seen))
    length = 2 * piece + 300
    numbered = torch.tensor([[1] * 300 + [0] * (2 * piece), [1] * 200 + [2] * (length - 200)])
    found = masks.numbered_segments(numbered)
    assert found.cu_seqlens() == [0, 300, length, length + 200, 2 * length]  # the DeltaNet layers' bounds
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 6, length, 8), torch.randn(2, 2, length, 8), torch.randn(2, 2, length, 8)
    cut = varlen.varlen_attention(varlen.ATEN_FLASH, query, key, value, found, 0.3)
    whole = varlen.varlen_attention(varlen.ATEN_FLASH, query, key, value, found, 0.3, padding_piece=0)
    assert [call["bounds"] for call in seen] == [
        [0, 300, 300 + piece, length, length + 200, 2 * length],
        found.cu_seqlens(),
    ]
    real = found.real_tokens("cpu").reshape(2, length)
    torch.testing.assert_close(cut[real], whole[real], rtol=0, atol=0)
    torch.testing.assert_close(cut[real], attention_per_segment(query, key, value, found, 0.3)[real])
    assert found.longest(piece) == found.longest() == length - 200
    padded_alone = masks.numbered_segments(torch.tensor([[1] * 10 + [0] * (piece + 1)]))
    assert padded_alone.cu_seqlens(piece) == [0, 10, 10 + piece, 11 + piece]
    assert padded_alone.longest(piece) == piece and padded_alone.longest() == piece + 1
    with pytest.raises(ValueError, match="a padding piece of -1 tokens"):
        padded_alone.cu_seqlens(-1)


def test_the_npu_varlen_call_passes_tnd_layout_cumulative_lengths_and_the_causal_tile(monkeypatch):
    """``npu_fusion_attention`` cannot run here (no NPU, no CANN): a stand-in ``torch_npu`` checks the call as
    Ascend documents it (layout ``TND``, ``actual_seq_qlen``/``actual_seq_kvlen`` the cumulative sample lengths
    without the leading 0, ``sparse_mode`` 3 with the compressed 2048 x 2048 causal tile, ``head_num`` the query
    heads, key heads shared) and computes attention by that definition."""
    import sys
    import types

    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    seen = {}

    def npu_fusion_attention(
        query, key, value, head_num, input_layout, *, atten_mask, scale, sparse_mode, actual_seq_qlen, actual_seq_kvlen
    ):
        seen.update(layout=input_layout, sparse_mode=sparse_mode, ends=list(actual_seq_qlen), heads=head_num)
        assert actual_seq_kvlen == actual_seq_qlen and actual_seq_qlen[-1] == query.shape[0]
        assert atten_mask.dtype == torch.bool and atten_mask.shape == (2048, 2048)
        assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
        out = torch.empty(query.shape[0], head_num, value.shape[-1], dtype=query.dtype)
        for start, end in zip([0, *actual_seq_qlen[:-1]], actual_seq_qlen, strict=True):
            part = torch.nn.functional.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1)[None] for t in (query, key, value)),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = part[0].transpose(0, 1)
        return out, None, None, None, 0, 0, 0

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=npu_fusion_attention))
    torch.manual_seed(0)
    numbered = torch.tensor([[1] * 9 + [2] * 20 + [0] * 3, [1] * 16 + [2] * 16])
    found = masks.segments(prepare_4d_attention_mask(numbered, torch.float32))
    query, key, value = torch.randn(2, 6, 32, 8), torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    ours = varlen.varlen_attention(varlen.NPU_VARLEN, query, key, value, found, 0.3)
    assert seen == {"layout": "TND", "sparse_mode": 3, "ends": [9, 29, 32, 48, 64], "heads": 6}
    torch.testing.assert_close(ours, attention_per_segment(query, key, value, found, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="FLA's Triton convolution needs CUDA")
def test_the_fla_convolution_with_cu_seqlens_equals_the_segment_reset_convolution():
    """The ``fused_ops`` route on a GPU: FLA's ``causal_conv1d`` given the row's ``cu_seqlens`` against the
    segment-reset torch convolution, at the 27B model's 10,240 channels, bf16, forward and backward."""
    import torch
    from fla.modules.causal_conv1d import causal_conv1d
    from llamafactory.data.collator import prepare_4d_attention_mask

    from patches.kernels.fused_kernels import FlaConv

    torch.manual_seed(0)
    channels, lens = 10240, (700, 1100, 1300, 900)
    numbered = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lens)] + [torch.zeros(96, dtype=torch.long)])
    found = masks.segments(prepare_4d_attention_mask(numbered[None], torch.float32))
    x = torch.randn(1, numbered.numel(), channels, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(channels, 4, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn_like(x)
    cu, cu_cpu = found.cu_seqlens_tensors("cuda")
    ours = FlaConv(causal_conv1d).varlen(x, weight, None, "silu", cu, cu_cpu)
    ours.backward(grad)
    got = (ours.detach(), x.grad.clone(), weight.grad.clone())
    x.grad, weight.grad = None, None
    ref = deltanet.segment_causal_conv(x.float().transpose(1, 2), weight.float()[:, None], None, found)
    ref.transpose(1, 2).backward(grad.float())
    for a, b in zip(got, (ref.transpose(1, 2), x.grad, weight.grad), strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.01


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="FlashAttention's varlen kernel needs CUDA")
@pytest.mark.parametrize("kernel", [varlen.ATEN_FLASH, varlen.TORCH_VARLEN])
def test_the_cuda_varlen_kernel_equals_the_block_mask_forward_and_backward(kernel):
    """Each CUDA varlen route on the 27B attention shape (24 query heads, 4 key heads, head dim 256, bf16) against
    SDPA under LLaMA-Factory's block mask: outputs and the gradients of q, k, v on real tokens, on rows whose padding
    the routes take in several pieces (``PADDING_PIECE``). ``ATEN_FLASH`` is the route a torch with the operator
    gets (checked here); ``varlen_attn`` where this torch has it (from 2.10)."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kernel == varlen.TORCH_VARLEN and varlen.torch_varlen_options() is None:
        pytest.skip("this torch has no varlen_attn (before 2.10)")
    if kernel == varlen.ATEN_FLASH and varlen.aten_flash_op() is None:
        pytest.skip("this torch has no FlashAttention operator with the expected arguments")
    torch.manual_seed(0)
    padding = 3 * varlen.PADDING_PIECE + 40
    numbered = torch.tensor([[1] * 700 + [2] * (2048 - 700 - padding) + [0] * padding, [1] * 1748 + [0] * 300])
    mask = prepare_4d_attention_mask(numbered, torch.bfloat16).cuda()
    found = masks.segments(mask)
    assert len(found.cu_seqlens(varlen.PADDING_PIECE)) == len(found.cu_seqlens()) + 3 + 2
    module = types_module = __import__("types").SimpleNamespace(is_causal=True, num_key_value_groups=6, training=True)
    del types_module
    query = torch.randn(2, 24, 2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    key = torch.randn(2, 4, 2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    value = torch.randn(2, 4, 2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if varlen.aten_flash_op() is not None:
        assert varlen.varlen_kernel(query, 256**-0.5, 0.0) == varlen.ATEN_FLASH
    results = []
    for run in ("varlen", "mask"):
        if run == "varlen":
            out = varlen.varlen_attention(kernel, query, key, value, found, 256**-0.5)
        else:
            out = sdpa_attention_forward(module, query, key, value, mask, scaling=256**-0.5)[0]
        real = found.real_tokens("cuda").reshape(2, 2048)
        (out[real].float() ** 2).sum().backward()
        results.append((out.detach(), [t.grad.clone() for t in (query, key, value)]))
        for t in (query, key, value):
            t.grad = None
    assert varlen.agreement(results[0][0], results[1][0], found) < packed_rows.VARLEN_AGREEMENT
    for ours, reference in zip(results[0][1], results[1][1], strict=True):
        assert float((ours.float() - reference.float()).norm() / reference.float().norm()) < 5e-2


def test_segments_are_read_off_the_mask_with_padding_as_its_own_segment():
    """The same segments read off LLaMA-Factory's 4D mask and off its sample numbers; the device mask built from the
    numbers is LLaMA-Factory's, entry for entry."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    numbered = torch.tensor([[1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2]])
    for dtype in (torch.float32, torch.bfloat16):
        mask = prepare_4d_attention_mask(numbered, dtype)
        assert torch.equal(masks.block_causal_mask(numbered.to(torch.int32), dtype), mask)
        on_meta = masks.block_causal_mask(numbered.to("meta", torch.int32), dtype)  # no tensor left on the CPU
        assert on_meta.device.type == "meta" and on_meta.shape == mask.shape and on_meta.dtype == dtype
        found = masks.segments(mask)
        from_numbers = masks.numbered_segments(numbered)
        assert from_numbers.spans == found.spans and torch.equal(from_numbers.position, found.position)
        assert found.spans == (
            (0, 0, 2, True),
            (0, 2, 5, True),
            (0, 5, 6, True),
            (0, 6, 8, False),
            (1, 0, 4, True),
            (1, 4, 8, True),
        )
        assert found.samples_per_row() == [3, 2]
        assert found.cu_seqlens() == [0, 2, 5, 6, 8, 12, 16]
        assert found.position.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]]
        assert masks.block_causal_mismatch(mask, found) == 0
    leaky = prepare_4d_attention_mask(torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]), torch.float32)
    leaky[0, 0, 3, 1] = torch.finfo(torch.float32).min  # a hole inside a sample: not block-diagonal causal
    assert masks.block_causal_mismatch(leaky, masks.segments(leaky)) == 1


def test_the_varlen_call_equals_the_kernel_run_per_sample():
    """The FLA route (one call, rows flattened to batch 1, ``cu_seqlens`` with the padding joined to the sample before
    it) against the per-sample route, on every sample token; the stand-in varlen kernel is transformers' torch
    reference split at ``cu_seqlens``, as FLA defines it. A row of one sample goes without ``cu_seqlens``."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from patches.kernels.recorder import CallLog, KernelRecorder

    seen = []

    def varlen(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        seen.append((q.shape[0], *(None if t is None else t.tolist() for t in (cu_seqlens, cu_seqlens_cpu))))
        bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        spans = zip(bounds[:-1], bounds[1:], strict=True)
        pieces = [
            torch_chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kwargs)[0]
            for s, e in spans
        ]
        return torch.cat(pieces, dim=1), None

    def recorder(kernel, label):
        return KernelRecorder(
            kernel, label=label, expected_device="cpu", log=CallLog(lambda call: None), patch="test", backend="cpu"
        )

    torch.manual_seed(0)
    for numbered, bounds in (
        ([[1] * 9 + [2] * 20 + [0] * 3, [1] * 16 + [2] * 16], [0, 9, 32, 48, 64]),
        ([[1] * 29 + [0] * 3], None),
    ):
        seen.clear()
        found = masks.segments(prepare_4d_attention_mask(torch.tensor(numbered), torch.float32))
        rows = found.rows
        inputs = [
            torch.randn(rows, 32, 2, 16),
            torch.randn(rows, 32, 2, 16),
            torch.randn(rows, 32, 2, 16),
            -torch.rand(rows, 32, 2),
            torch.rand(rows, 32, 2),
        ]
        real = found.real_tokens("cpu").reshape(rows, 32)
        results = []
        for kernel, label in ((varlen, "fla"), (torch_chunk_gated_delta_rule, "torch")):
            leaves = [t.clone().requires_grad_() for t in inputs]
            out = deltanet.chunk_per_segment(recorder(kernel, label), *leaves, found)
            (out[real] ** 2).sum().backward()  # the loss reads the samples' tokens only
            results.append((out.detach(), [t.grad for t in leaves]))
        assert seen == [(1, bounds, bounds)]
        (fla, fla_grads), (per_sample, per_sample_grads) = results
        torch.testing.assert_close(fla[real], per_sample[real], rtol=1e-5, atol=1e-6)
        assert fla.shape == inputs[2].shape and not torch.allclose(fla[~real], per_sample[~real])  # padding joined
        for ours, reference in zip(fla_grads, per_sample_grads, strict=True):  # padding tokens' gradients: 0 in both
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_the_deltanet_bounds_join_the_padding_to_the_sample_before_it():
    """``cu_seqlens(joined=True)`` and ``state_bounds``: padding after a sample becomes part of it, padding that
    opens a row stays its own segment, and one row of one sample is one sequence (no ``cu_seqlens``)."""
    import torch

    def found(numbered):
        return masks.numbered_segments(torch.tensor(numbered, dtype=torch.int32))

    two_rows = found([[1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2]])
    assert two_rows.cu_seqlens() == [0, 2, 5, 6, 8, 12, 16]
    assert two_rows.cu_seqlens(joined=True) == [0, 2, 5, 8, 12, 16]
    cu, cu_cpu = two_rows.state_bounds("cpu")
    assert cu.tolist() == cu_cpu.tolist() == [0, 2, 5, 8, 12, 16] and cu.dtype == torch.long
    assert two_rows.state_bounds("cpu")[0] is cu  # built once per batch
    assert found([[0, 0, 1, 1, 1, 0]]).cu_seqlens(joined=True) == [0, 2, 6]
    assert found([[1, 1, 1, 0, 0]]).state_bounds("cpu") == (None, None) and not two_rows.one_sequence()
    assert found([[1, 1, 1, 1]]).state_bounds("cpu") == (None, None)
    assert found([[1, 1, 0, 0], [1, 1, 1, 0]]).cu_seqlens(joined=True) == [0, 4, 8]  # two rows: two sequences
    with pytest.raises(ValueError, match="either cut into pieces or joined"):
        two_rows.cu_seqlens(piece=2, joined=True)


def test_the_fla_route_takes_key_heads_unrepeated_and_pairs_them_as_transformers_does():
    """Two key heads serving six value heads. On the FLA route ``value_heads`` hands the kernel the key heads as they
    are; the stand-in kernel pairs value head ``j`` with key head ``j // (HV // H)`` (fla-core 0.6's grouped value
    attention, its kernels' ``i_h // (HV // H)``) and is transformers' torch reference otherwise. Its answer equals the
    torch route's, which gets them repeated as transformers repeats them; a pairing that interleaved the heads the
    other way (``repeat``) would not."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from patches.kernels.recorder import CallLog, KernelRecorder

    heads_seen = []
    grouped = grouped_varlen_kernel(seen=heads_seen)

    def recorder(kernel, label):
        return KernelRecorder(
            kernel, label=label, expected_device="cpu", log=CallLog(lambda call: None), patch="test", backend="cpu"
        )

    torch.manual_seed(0)
    found = masks.segments(prepare_4d_attention_mask(torch.tensor([[1] * 12 + [2] * 20]), torch.float32))
    q, k = torch.randn(1, 32, 2, 16), torch.randn(1, 32, 2, 16)
    v, g, beta = torch.randn(1, 32, 6, 16), -torch.rand(1, 32, 6), torch.rand(1, 32, 6)
    fla_kernel, torch_kernel = recorder(grouped, "fla"), recorder(torch_chunk_gated_delta_rule, "torch")
    fla_q, fla_k = deltanet.value_heads(fla_kernel, q, k, 3)
    assert fla_q is q and fla_k is k  # no copy on the FLA route
    fla = deltanet.chunk_per_segment(fla_kernel, fla_q, fla_k, v, g, beta, found)
    assert heads_seen == [(2, 2, 6)]
    reference = deltanet.chunk_per_segment(
        torch_kernel, *deltanet.value_heads(torch_kernel, q, k, 3), v, g, beta, found
    )
    torch.testing.assert_close(fla, reference, rtol=1e-5, atol=1e-6)
    other_pairing = deltanet.chunk_per_segment(
        torch_kernel, q.repeat(1, 1, 3, 1), k.repeat(1, 1, 3, 1), v, g, beta, found
    )
    assert not torch.allclose(fla, other_pairing, rtol=1e-3, atol=1e-4)


def test_the_segment_convolution_equals_the_convolution_of_each_sample_alone():
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3, bias=True)
    x = torch.randn(2, 6, 12)
    numbered = torch.tensor([[1] * 5 + [2] * 2 + [3] * 5, [1] * 1 + [2] * 8 + [0] * 3])
    found = masks.segments(prepare_4d_attention_mask(numbered, torch.float32))
    ours = deltanet.segment_causal_conv(x, conv.weight, conv.bias, found)
    with torch.no_grad():
        alone = torch.zeros_like(ours)
        for row, start, end, _ in found.spans:
            sample = conv(x[row : row + 1, :, start:end])[0, :, : end - start]
            alone[row, :, start:end] = torch.nn.functional.silu(sample)
    torch.testing.assert_close(ours, alone, rtol=1e-6, atol=1e-6)
    rows, cols, offsets = found.heads(4, "cpu")
    assert cols.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 0, 1, 2, 3, 9, 10, 11] and offsets.max().item() == 2


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_packing_trains_through_the_launcher_with_the_packed_path_proven(tmp_path, demo_assets, workers):
    """``packing: true`` through ``launcher run`` and real LLaMA-Factory 0.9.5 on CPU: the launcher turns it into
    neat packing, the collator's position ids restart per sample, the DeltaNet layers run the packed path; also
    with the collator in a DataLoader worker (``dataloader_num_workers: 1``), where the training process counts
    and records the packed batches the model meets."""
    import yaml

    from tests.support.common import launcher_cmd, make_config, only_run_dir

    cut = {"patches": {"packed_rows": {"cut_padding": 16}}} if workers else None
    cfg = make_config(
        tmp_path,
        demo_assets,
        cut,
        packing=True,
        max_steps=2,
        save_strategy="no",
        eval_steps=2,
        dataloader_num_workers=workers,
    )
    proc = launcher_cmd("run", cfg, "--quiet")
    run_dir = only_run_dir(tmp_path / "runs")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    written = yaml.safe_load((run_dir / "llamafactory.yaml").read_text())
    assert written["neat_packing"] is True and written["dataloader_num_workers"] == workers
    record = read_proof(run_dir / "proof", "packed_rows")
    assert record["status"] == "applied" and record["packing"] is True
    batch, call, step = record["first_packed_batch"], record["first_packed_call"], record["first_training_step"]
    # rows of (cutoff_len - 1) + 1 = 256 tokens; with cut_padding 16 (workers) the batch is cut after the last sample
    # token of its fullest row, rounded up to 16: the demo data's first batch holds 17 padding tokens in that row
    assert batch["row_length"] == (240 if workers else 256) and max(batch["samples_per_row"]) >= 2, batch
    assert batch["position_ids"].startswith("restart at 0") and batch["mask"].startswith("sample numbers (int32)")
    assert call["samples_per_row"] == batch["samples_per_row"] and call["kernel_label"] == "torch"
    assert step["packed_deltanet_calls"] >= 3  # the demo model's three DeltaNet layers, at least once each
