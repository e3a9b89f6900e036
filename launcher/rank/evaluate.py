"""What ``launcher evaluate`` runs in its child process: test loss and greedy answers per checkpoint.

    python -m launcher.rank.evaluate REQUEST_JSON

One process on one device (the run's backend from ``launch.json``). The patches are applied as in training
(``patches.apply_enabled`` with the run's settings, before the model is built), so the DeltaNet chunk and
recurrent kernels are the routed ones and their first calls are recorded; the record goes into the results.
LLaMA-Factory's own pieces do the data work (``get_train_args`` on the run's YAML, ``load_tokenizer``,
``get_template_and_fix_tokenizer``, ``get_dataset`` for the tokenized test split, its SFT collator) and load
the base model read-only (``load_model`` without an adapter). Each checkpoint's adapter is attached with
``PeftModel.from_pretrained`` / ``load_adapter`` and selected with ``set_adapter``: nothing is merged, copied
or written next to the model or the checkpoints.

Test loss: the model's loss per batch of ``per_device_eval_batch_size`` (the mean over its supervised tokens),
averaged over samples, as the HF Trainer computes ``eval_loss``. Prompts: the first client turn of each test
conversation (LLaMA-Factory's aligned ``_prompt``, with the record's system prompt), then the extra prompts of
the request, encoded with the run's template (``encode_oneturn``) and answered greedily.

Progress goes to stdout as counts; the generated text only into the result file the parent turns into
``evaluate.json``. LLaMA-Factory's example dump is replaced by token counts (``launcher.data.privacy``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.files import write_json_atomic
from launcher.state.runs import OUTPUT_SUBDIR, PROOF_DIR

TEST_DATASET = "launcher_test_split"


def _say(message: str) -> None:
    print(f"evaluate: {message}", flush=True)


def _lf_args(request: dict[str, Any], work: Path) -> dict[str, Any]:
    """The run's LLaMA-Factory arguments turned into an evaluation of the test split (no training, no save)."""
    args = dict(request["lf_args"])
    for key in (
        "adapter_name_or_path",
        "resume_from_checkpoint",
        "deepspeed",
        "val_size",
        "max_samples",
        "load_best_model_at_end",
        "metric_for_best_model",
        "tokenized_path",
        "eval_on_each_dataset",
    ):
        args.pop(key, None)
    args.update(
        dataset=None,
        eval_dataset=TEST_DATASET,
        dataset_dir=str(work),
        do_train=False,
        do_eval=True,
        do_predict=False,
        predict_with_generate=False,
        output_dir=str(work / OUTPUT_SUBDIR),
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        overwrite_output_dir=True,
        packing=False,
        neat_packing=False,
        streaming=False,
        preprocessing_num_workers=None,
        ddp_timeout=None,
    )  # (never packed)
    return {k: v for k, v in args.items() if v is not None}


def _register_test_split(request: dict[str, Any], work: Path) -> None:
    split = request["test_split"]
    entry = {**split["dataset_info"], "file_name": str(Path(split["path"]).resolve())}
    (work / "dataset_info.json").write_text(json.dumps({TEST_DATASET: entry}))


def _first_turns(aligned, limit: int) -> list[dict[str, Any]]:
    """The first client turn of each test conversation (in file order, once each) and its reference reply."""
    prompts, seen = [], set()
    for row in aligned:
        turns, response = row["_prompt"], row["_response"]
        if not turns or turns[0]["role"] != "user" or turns[0]["content"] in seen:
            continue
        seen.add(turns[0]["content"])
        reference = turns[1]["content"] if len(turns) > 1 else (response[0]["content"] if response else None)
        prompts.append(
            {
                "id": f"test-{len(prompts) + 1}",
                "kind": "test",
                "prompt": turns[0]["content"],
                "reference": reference,
                "system": row.get("_system") or None,
            }
        )
        if limit and len(prompts) >= limit:
            break
    return prompts


def routed_bindings(model) -> dict[str, int]:
    """How many DeltaNet layers are bound to the routing patch's recorders (the training run checks this at its
    first step; generation has no training step, so it is counted here and written into evaluate.json)."""
    from patches.kernels.recorder import KernelRecorder

    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    return {
        "deltanet_layers": len(layers),
        "routed_chunk_layers": sum(isinstance(x.chunk_gated_delta_rule, KernelRecorder) for x in layers),
        "routed_decode_layers": sum(isinstance(x.recurrent_gated_delta_rule, KernelRecorder) for x in layers),
    }


def _device(backend: str):
    from launcher.config.backend import device_name

    return device_name(backend)


def test_loss(torch, model, dataset, collator, batch_size: int, device) -> dict[str, Any]:
    """The mean of the batches' mean losses: what the Trainer reports as ``eval_loss`` (transformers 5.6.0's
    evaluation loop repeats each batch's loss by the loader's batch size, a short last batch too, and averages),
    so the test loss sits on the same scale as the validation curve."""
    from llamafactory.extras.constants import IGNORE_INDEX
    from torch.utils.data import DataLoader

    losses, samples, tokens = [], 0, 0
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collator, shuffle=False)
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
            losses.append(float(model(**batch).loss))
            samples += int(batch["input_ids"].shape[0])
            tokens += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return {
        "test_loss": round(sum(losses) / len(losses), 6) if losses else None,
        "test_samples": samples,
        "test_tokens": tokens,
    }


def encode_prompts(template, tokenizer, prompts, cutoff: int) -> tuple[list[list[int]], int]:
    """Each prompt's ids with the run's template, and how many were longer than ``cutoff`` (the longest the model
    trained on) and were cut to their last ``cutoff`` tokens (the question's end)."""
    encoded, cut = [], 0
    for p in prompts:
        messages = [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": ""}]
        prompt_ids, _ = template.encode_oneturn(tokenizer, messages, p.get("system"))
        if len(prompt_ids) > cutoff:
            prompt_ids, cut = prompt_ids[-cutoff:], cut + 1
        encoded.append(prompt_ids)
    return encoded, cut


def batch_rows(
    torch, model, encoded: list[list[int]], setting: int | str, max_new_tokens: int, device
) -> tuple[int, dict[str, Any]]:
    """Rows per greedy batch for ``setting`` (a number, or ``auto``: ``evaluate_decode.auto_rows`` on the model's
    forecast row, ``launcher.checks.memory.decode_row_bytes``), and what the choice rests on."""
    from launcher.checks.memory import decode_row_bytes, read_shape
    from launcher.rank.evaluate_decode import AUTO, FALLBACK_ROWS, auto_rows, free_memory

    if setting != AUTO:
        return int(setting), {"setting": int(setting)}
    try:
        shape = read_shape(model.config.to_dict())
    except ValueError as err:  # UnsupportedModel: not a Qwen3.5 config
        return FALLBACK_ROWS, {"setting": AUTO, "forecast": f"not made ({err}); {FALLBACK_ROWS} rows"}
    act_bytes = model.get_input_embeddings().weight.element_size()
    row = decode_row_bytes(shape, max(map(len, encoded), default=1), max_new_tokens, act_bytes)
    try:
        free = free_memory(torch, device)
    except (AttributeError, RuntimeError) as err:  # a device module without mem_get_info
        return FALLBACK_ROWS, {"setting": AUTO, "forecast": f"free memory not read ({err}); {FALLBACK_ROWS} rows"}
    rows, basis = auto_rows(len(encoded), row, *free)
    return rows, {"setting": AUTO, **basis}


def generate(
    torch,
    model,
    tokenizer,
    encoded: list[list[int]],
    stop: list[int],
    max_new_tokens: int,
    device,
    batch_size: int,
    name: str = "",
) -> tuple[list[str], dict[str, Any]]:
    """Greedy answers to ``encoded``, ``batch_size`` prompts at a time (``launcher.rank.evaluate_decode``: the same
    tokens as one at a time), and the decoding's token count and seconds."""
    from launcher.rank.evaluate_decode import greedy_batched

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    last = []

    def progress(p) -> None:
        last[:] = [p]
        _say(
            f"{name}: {p.done}/{p.total} answers, {p.tokens} tokens in {p.seconds:.1f} s "
            f"({p.tokens_per_s:.1f} tokens/s)"
        )

    tokens = greedy_batched(
        torch,
        model,
        encoded,
        max_new_tokens=max_new_tokens,
        stop=stop,
        pad_id=pad,
        batch_size=batch_size,
        device=device,
        progress=progress,
    )
    answers = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
    done = last[0] if last else None
    decoding = {
        "batch_size": batch_size,
        "generated_tokens": sum(len(t) for t in tokens),
        "answers_at_limit": sum(len(t) == max_new_tokens and t[-1] not in stop for t in tokens),
        "decode_seconds": round(done.seconds, 2) if done else 0.0,
        "tokens_per_s": round(done.tokens_per_s, 2) if done else None,
    }
    return answers, decoding


def evaluate(request: dict[str, Any]) -> dict[str, Any]:
    """Run the whole evaluation of ``request`` (see ``launcher.run.evaluate``) and return the raw results."""
    import patches
    from patches.core.proof import RankInfo, read_proof

    backend = request["backend"]
    work = Path(request["work_dir"])
    patches.apply_enabled(request["patches"], backend=backend, proof_dir=work / PROOF_DIR, facts=request["facts"])
    if not request["log_examples"]:
        from launcher.data.privacy import protect_training_log

        protect_training_log()

    import torch
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.data.loader import _get_merged_dataset  # LLaMA-Factory 0.9.5: the aligned records
    from llamafactory.extras.constants import IGNORE_INDEX
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer
    from peft import PeftModel

    _register_test_split(request, work)
    model_args, data_args, training_args, finetuning_args, _ = get_train_args(_lf_args(request, work))
    tokenizer_module = load_tokenizer(model_args)
    tokenizer = tokenizer_module["tokenizer"]
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    dataset = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    test_set = dataset["eval_dataset"]
    aligned = _get_merged_dataset([TEST_DATASET], model_args, data_args, training_args, "sft")
    prompts = _first_turns(aligned, request["max_test_prompts"])
    system = next((p["system"] for p in prompts if p.get("system")), None)  # what training put before the client
    prompts += [{**p, "system": system} for p in request["extra_prompts"]]
    _say(f"{len(test_set)} test samples, {len(prompts)} prompts, {len(request['checkpoints'])} checkpoint(s)")

    device = _device(backend)
    base = load_model(tokenizer, model_args, finetuning_args, is_trainable=False)  # no adapter: the base, frozen
    base.to(device)
    bindings = routed_bindings(base)
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template,
        model=base,
        pad_to_multiple_of=None,
        label_pad_token_id=IGNORE_INDEX,
        block_diag_attn=model_args.block_diag_attn,
        neat_packing=data_args.neat_packing,
        attn_implementation=getattr(base.config, "_attn_implementation", None),
        compute_dtype=model_args.compute_dtype,
        **tokenizer_module,
    )
    encoded, cut = encode_prompts(template, tokenizer, prompts, data_args.cutoff_len)
    stop = template.get_stop_token_ids(tokenizer)
    rows, basis = batch_rows(torch, base, encoded, request["batch_size"], request["max_new_tokens"], device)
    line = f"greedy batches of {rows} prompt(s)"
    if "row_mib" in basis:
        line += (
            f" (auto: {basis['free_gib']} GiB free, {basis['row_mib']} MiB a row, "
            f"{basis['kept_free_gib']} GiB kept free)"
        )
        if not basis["rows_that_fit"]:
            line += "; by the forecast not even one row fits: free the device, or expect it to run out of memory"
    elif "forecast" in basis:
        line += f" (auto: forecast {basis['forecast']})"
    _say(line)
    if cut:
        _say(
            f"{cut} prompt(s) longer than cutoff_len {data_args.cutoff_len} keep their last {data_args.cutoff_len} "
            "tokens"
        )
    model = None
    results: list[dict[str, Any]] = []
    for index, ckpt in enumerate(request["checkpoints"]):
        started = time.monotonic()
        adapter = f"a{index}"  # adapter names become module keys: no dots or slashes
        if model is None:
            model = PeftModel.from_pretrained(base, ckpt["path"], adapter_name=adapter, is_trainable=False)
        else:
            model.load_adapter(ckpt["path"], adapter_name=adapter, is_trainable=False)
        model.set_adapter(adapter)
        model.to(device).eval()
        _say(f"{ckpt['name']}: test loss over {len(test_set)} samples")
        loss_started = time.monotonic()
        found = test_loss(torch, model, test_set, collator, training_args.per_device_eval_batch_size, device)
        found["test_loss_seconds"] = round(time.monotonic() - loss_started, 1)  # ``seconds``: the whole checkpoint
        _say(f"{ckpt['name']}: test loss {found['test_loss']}; {len(prompts)} greedy answers")
        answers, decoding = generate(
            torch, model, tokenizer, encoded, stop, request["max_new_tokens"], device, rows, ckpt["name"]
        )
        seconds = round(time.monotonic() - started, 1)
        results.append(
            {
                "name": ckpt["name"],
                "step": ckpt["step"],
                "path": ckpt["path"],
                **found,
                "answers": answers,
                "prompts_cut": cut,
                "seconds": seconds,
                "decoding": {**decoding, "batch_size_basis": basis},
            }
        )
    rows = [
        {**{k: v for k, v in p.items() if k != "system"}, "answers": {r["name"]: r["answers"][i] for r in results}}
        for i, p in enumerate(prompts)
    ]
    for r in results:
        r.pop("answers")
    rank = RankInfo.from_env().rank
    proof = read_proof(work / PROOF_DIR, "deltanet_routing", rank)
    glue = read_proof(work / PROOF_DIR, "fused_ops", rank)  # the convolution, norms and SwiGLU the answers ran on
    kernels = {
        **{k: proof.get(k) for k in ("status", "route", "first_call", "first_decode_call")},
        **bindings,
        "fused_ops": {
            "status": glue.get("status"),
            **{op: c.get("callable") for op, c in (glue.get("ops") or {}).items()},
        },
    }
    return {"checkpoints": results, "prompts": rows, "kernels": kernels}


def main(argv: list[str] | None = None, prepare: Callable[[dict[str, Any]], None] | None = None) -> int:
    """``python -m launcher.rank.evaluate REQUEST_JSON``; ``prepare`` gets the request before anything is loaded (a
    measuring wrapper's set-up: ``benchmarks.evaluate_entry``)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m launcher.rank.evaluate REQUEST_JSON", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if prepare is not None:
        prepare(request)
    raw = evaluate(request)
    write_json_atomic(Path(request["result_file"]), raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
