"""Batched greedy answers equal one-at-a-time answers token for token (tiny model, fp32, CPU), and a planted
leak between the rows of a batch breaks that equality."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from launcher.checks.memory import GIB, decode_cache_bytes, read_shape  # noqa: E402
from launcher.rank.evaluate_decode import AUTO_MAX_ROWS, Progress, auto_rows, cut_at_stop, greedy_batched  # noqa: E402

# prompt lengths far apart: shorter than the conv kernel (4), across the torch chunk kernel's 64-token chunks
LENGTHS = (1, 3, 150, 17, 70, 129, 5, 64)
NEW_TOKENS = 12
PAD = 3  # a token with a non-zero embedding, as a real pad token (token 0 is the embedding's zero padding_idx row)


@pytest.fixture(scope="module")
def tiny(demo_assets):
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(demo_assets["model"], dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.text_config.vocab_size
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    return model, prompts


def _answers(model, prompts, stop, batch_size, progress=None):
    return greedy_batched(
        torch,
        model,
        prompts,
        max_new_tokens=NEW_TOKENS,
        stop=stop,
        pad_id=PAD,
        batch_size=batch_size,
        device="cpu",
        progress=progress,
    )


@pytest.fixture(scope="module")
def one_at_a_time(tiny):
    """The reference: batch 1 (no padding), with a stop token that some answers meet early and others never."""
    model, prompts = tiny
    free = _answers(model, prompts, stop=[-1], batch_size=1)
    stop = [free[0][2]]  # the third token of the first answer: that row stops early, at its own step
    return stop, _answers(model, prompts, stop=stop, batch_size=1)


def test_answers_in_batches_equal_one_at_a_time_token_for_token(tiny, one_at_a_time):
    model, prompts = tiny
    stop, single = one_at_a_time
    lengths = {len(a) for a in single}
    assert len(lengths) > 1 and NEW_TOKENS in lengths and single[0][-1] == stop[0]  # rows end at different steps
    seen: list[Progress] = []
    for batch_size in (3, 8):
        seen.clear()
        assert _answers(model, prompts, stop, batch_size, seen.append) == single, f"batch size {batch_size}"
    assert [(p.done, p.total) for p in seen] == [(8, 8)] and seen[-1].tokens == sum(len(a) for a in single)


def test_a_short_last_batch_is_filled_to_the_batch_size_and_its_copies_are_not_answers(
    tiny, one_at_a_time, monkeypatch
):
    """8 prompts in batches of 3: three ``generate`` calls of 3 rows each (the last one 2 prompts and a copy), so
    the decoding kernels see one batch size; the answers are still the one-at-a-time answers, one per prompt."""
    model, prompts = tiny
    stop, single = one_at_a_time
    sizes: list[int] = []
    real_generate = model.generate

    def counting(*args, input_ids, **kwargs):
        sizes.append(int(input_ids.shape[0]))
        return real_generate(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "generate", counting)
    seen: list[Progress] = []
    assert _answers(model, prompts, stop, 3, seen.append) == single
    assert sizes == [3, 3, 3]
    assert [p.done for p in seen] == [3, 6, 8] and seen[-1].tokens == sum(len(a) for a in single)
    sizes.clear()
    _answers(model, prompts[:2], stop, 3)  # one batch: nothing to match, nothing added
    assert sizes == [2]


def _drop_deltanet_padding_mask(monkeypatch, model):
    from transformers.models.qwen3_5 import modeling_qwen3_5

    monkeypatch.setattr(modeling_qwen3_5, "apply_mask_to_padding_states", lambda hidden, mask: hidden)


def _share_row_zero_state(monkeypatch, model):
    """Every row decodes from row 0's recurrent state (a cache that is not per row)."""
    for layer in (m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"):
        kernel = layer.recurrent_gated_delta_rule

        def shared(*args, initial_state=None, _kernel=kernel, **kwargs):
            if initial_state is not None:
                initial_state = initial_state[:1].expand_as(initial_state).contiguous()
            return _kernel(*args, initial_state=initial_state, **kwargs)

        monkeypatch.setattr(layer, "recurrent_gated_delta_rule", shared)


@pytest.mark.parametrize("plant", [_drop_deltanet_padding_mask, _share_row_zero_state])
def test_a_planted_leak_between_rows_changes_the_answers(tiny, one_at_a_time, monkeypatch, plant):
    """The equality above is not vacuous: pads that reach the DeltaNet state, or a state shared across rows,
    change answers."""
    model, prompts = tiny
    stop, single = one_at_a_time
    plant(monkeypatch, model)
    assert _answers(model, prompts, stop, 8) != single


def test_prompt_logits_of_a_left_padded_row_equal_the_unpadded_rows(tiny):
    """The prompt's pass alone (chunk kernel, conv, full attention with the mask and position ids)."""
    model, prompts = tiny
    short, long = prompts[1], prompts[2]
    ids = torch.tensor([[PAD] * (len(long) - len(short)) + short, long])
    mask = (torch.arange(len(long)) >= len(long) - len(short)).long()
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=torch.stack([mask, torch.ones_like(mask)])).logits[:, -1]
        alone = [model(input_ids=torch.tensor([p])).logits[0, -1] for p in (short, long)]
    torch.testing.assert_close(batched, torch.stack(alone), rtol=1e-4, atol=1e-4)


def test_an_answer_ends_at_its_first_stop_token():
    assert cut_at_stop([5, 6, 2, 0, 0], [2, 7]) == [5, 6, 2]
    assert cut_at_stop([5, 6], [2]) == [5, 6]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cache_forecast_is_the_tiny_models_real_generation_cache(demo_assets, dtype):
    """``decode_cache_bytes`` (what ``--batch-size auto`` prices a row's cache at) against every tensor of the cache
    transformers builds for 3 rows of 20 tokens on the tiny model: the recurrent state is cached in the model's
    dtype (``LinearAttentionLayer`` allocates it like the conv state, whatever dtype the kernel returned)."""
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(demo_assets["model"], dtype=dtype).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(10, 100, (3, 20)), use_cache=True).past_key_values
    held = sum(t.nbytes for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))
    shape = read_shape(model.config.to_dict())
    assert held == 3 * decode_cache_bytes(shape, 20, act_bytes=dtype.itemsize) > 0


@pytest.mark.parametrize(
    ("prompts", "free_gib", "rows"),
    [(38, 100.0, 38), (500, 100.0, AUTO_MAX_ROWS), (38, 8.0, 15), (38, 1.0, 1)],
)
def test_auto_rows_fill_the_free_memory_less_the_slack_up_to_the_cap_and_the_prompts(prompts, free_gib, rows):
    """A 64 GiB device with ``free_gib`` free and 0.25 GiB a row: 1 GiB and 5 % of the device (3.2 GiB) kept free."""
    found, basis = auto_rows(prompts, int(0.25 * GIB), int(free_gib * GIB), 64 * GIB)
    assert found == rows
    assert basis["kept_free_gib"] == 4.2 and basis["rows_that_fit"] == max(0, int((free_gib - 4.2) / 0.25))


def test_auto_prices_a_row_at_the_longest_prompt_the_answer_length_and_the_models_dtype(tiny, monkeypatch):
    """``batch_rows`` with the free memory read as 3.5 rows beyond what is kept free, each row priced independently
    here at the longest prompt (150 tokens), ``NEW_TOKENS`` and fp32: 3 rows. A price at the shortest prompt, at
    another answer length or in another dtype would fit more or fewer."""
    from launcher.checks.memory import SLACK_GIB, SLACK_SHARE, decode_row_bytes
    from launcher.rank import evaluate_decode
    from launcher.rank.evaluate import batch_rows

    model, prompts = tiny
    row = decode_row_bytes(read_shape(model.config.to_dict()), max(LENGTHS), NEW_TOKENS, act_bytes=4)
    total = 64 * GIB
    kept = int(SLACK_GIB * GIB + SLACK_SHARE * total)
    monkeypatch.setattr(evaluate_decode, "free_memory", lambda torch_, device: (kept + 7 * row // 2, total))
    rows, basis = batch_rows(torch, model, prompts, "auto", NEW_TOKENS, "cpu")
    assert rows == 3 and basis["rows_that_fit"] == 3 and basis["row_mib"] == round(row / 2**20, 2)


def test_free_memory_on_an_accelerator_counts_the_allocators_unused_blocks_as_free():
    """The accelerator branch with a stand-in device module (no GPU or NPU here; CUDA's device string, torch_npu
    registers the same calls on ``torch.npu``): ``mem_get_info``'s free bytes plus the caching allocator's reserved
    but unallocated bytes, and the device's total."""
    from types import SimpleNamespace

    from launcher.rank.evaluate_decode import free_memory

    seen = []

    def info(device):
        seen.append(device)
        return 10 * GIB, 80 * GIB

    module = SimpleNamespace(mem_get_info=info, memory_reserved=lambda d: 7 * GIB, memory_allocated=lambda d: 5 * GIB)
    fake = SimpleNamespace(device=torch.device, cuda=module)
    assert free_memory(fake, "cuda:0") == (12 * GIB, 80 * GIB) and seen == [torch.device("cuda:0")]


def test_auto_falls_back_to_16_rows_saying_why_when_no_forecast_can_be_made(tiny, monkeypatch):
    """``batch_rows`` on the tiny model: ``auto`` with the host's memory takes every prompt; a device module that
    cannot report its free memory, or a config that is not Qwen3.5, gives the fallback and the reason; a number is
    taken as it is."""
    from launcher.rank import evaluate_decode
    from launcher.rank.evaluate import batch_rows

    model, prompts = tiny
    rows, basis = batch_rows(torch, model, prompts, "auto", NEW_TOKENS, "cpu")
    assert rows == len(prompts) and basis["setting"] == "auto" and basis["rows_that_fit"] > len(prompts)
    assert batch_rows(torch, model, prompts, 3, NEW_TOKENS, "cpu") == (3, {"setting": 3})

    def unreadable(torch_, device):
        raise AttributeError("module 'torch.npu' has no attribute 'mem_get_info'")

    monkeypatch.setattr(evaluate_decode, "free_memory", unreadable)
    rows, basis = batch_rows(torch, model, prompts, "auto", NEW_TOKENS, "cpu")
    assert rows == 16 and "free memory not read" in basis["forecast"] and "mem_get_info" in basis["forecast"]
    monkeypatch.setattr(model.config, "to_dict", lambda: {"model_type": "llama", "hidden_size": 8})
    rows, basis = batch_rows(torch, model, prompts, "auto", NEW_TOKENS, "cpu")
    assert rows == 16 and basis["forecast"].startswith("not made (")
